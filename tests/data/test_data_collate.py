"""Collators: shapes, padding sides, margins; length-grouped ordering keeps every row once."""

import random

import pytest
import torch
from data_fixtures import make_cfg  # noqa: F401 (pytest fixtures)

from rlhf_cli.data import PackedPairCollator, PairCollator, PromptCollator, epoch_order, example_length

PAD, EOS = 0, 2


def _pair(p, c, r, **kw):
    return {"prompt_ids": p, "chosen_ids": c, "rejected_ids": r, "row": 1, **kw}


def test_pair_collator_right_pads_chosen_then_rejected():
    exs = [_pair([5, 6], [7, EOS], [8, 9, 9, EOS]), _pair([5], [7, 7, EOS], [8, EOS])]
    b = PairCollator(PAD)(exs)
    assert set(b) == {"input_ids", "attention_mask", "pair_tokens", "prompt_lengths"}
    assert int(b["pair_tokens"]) == 4 + 4 + 6 + 3 and b["prompt_lengths"].tolist() == [2, 1]
    assert b["input_ids"].shape == b["attention_mask"].shape == (4, 6) and b["input_ids"].dtype == torch.long
    assert b["input_ids"].tolist() == [[5, 6, 7, EOS, PAD, PAD],      # chosen 0
                                       [5, 7, 7, EOS, PAD, PAD],      # chosen 1
                                       [5, 6, 8, 9, 9, EOS],          # rejected 0
                                       [5, 8, EOS, PAD, PAD, PAD]]    # rejected 1
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0], [1] * 6, [1, 1, 1, 0, 0, 0]]
    last = b["attention_mask"].sum(1) - 1  # right padding: the EOS is the last real token
    assert b["input_ids"][torch.arange(4), last].tolist() == [EOS] * 4


def test_packed_pair_collator_layout():
    """One trie per pair (the prompt, then chosen's and rejected's own tokens), first-fit longest first into rows
    as wide as the longest trie; rejected positions continue from the prompt; rejected never sees chosen; padding
    sees itself."""
    exs = [_pair([5, 6], [7, EOS], [8, 9, 9, EOS]), _pair([5], [7, 7, EOS], [8, EOS]), _pair([4], [EOS], [9])]
    b = PackedPairCollator(PAD)(exs)
    # segment lengths 8, 6, 3 in rows of 8: pair 2 does not fit after pair 1 (6 + 3 > 8), so three rows
    assert b["input_ids"].tolist() == [[5, 6, 7, EOS, 8, 9, 9, EOS],
                                       [5, 7, 7, EOS, 8, EOS, PAD, PAD],
                                       [4, EOS, 9, PAD, PAD, PAD, PAD, PAD]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 2, 3, 4, 5], [0, 1, 2, 3, 1, 2, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert b["chosen_end"].tolist() == [[0, 3], [1, 3], [2, 1]]
    assert b["rejected_end"].tolist() == [[0, 7], [1, 5], [2, 2]]
    assert int(b["pair_tokens"]) == (4 + 6) + (4 + 3) + (2 + 2)
    assert b["prompt_lengths"].tolist() == [2, 1, 1] and b["prompt_lengths"].dtype == torch.long
    assert b["attention_mask"].tolist()[2] == [1, 1, 1, 0, 0, 0, 0, 0]
    allowed = b["pair_attention"][:, 0]
    assert allowed.dtype == torch.bool and allowed.shape == (3, 8, 8)
    assert allowed[0, 4].tolist() == [True, True, False, False, True, False, False, False]  # rejected: prompt + itself
    assert allowed[0, 3].tolist() == [True] * 4 + [False] * 4  # chosen EOS: prompt + chosen
    assert allowed[2, 2].tolist() == [True, False, True] + [False] * 5  # one-token prompt, one-token responses
    assert allowed[2, 5].tolist() == [False] * 5 + [True, False, False]  # padding attends to itself only
    # two short pairs share a row
    b = PackedPairCollator(PAD)([_pair([5, 6, 7], [7, EOS], [8, EOS]), _pair([4], [EOS], [9]),
                                 _pair([3], [EOS], [9, EOS])])
    assert b["input_ids"].tolist() == [[5, 6, 7, 7, EOS, 8, EOS], [3, EOS, 9, EOS, 4, EOS, 9]]
    assert b["chosen_end"].tolist() == [[0, 4], [1, 5], [1, 1]]
    assert b["rejected_end"].tolist() == [[0, 6], [1, 6], [1, 3]]
    allowed = b["pair_attention"][1, 0]
    assert allowed[4].tolist() == [False] * 4 + [True] + [False] * 2  # the second pair's prompt sees only itself
    assert allowed[6].tolist() == [False] * 4 + [True, False, True]
    # chosen and rejected that begin alike share those positions; identical ones share every position
    b = PackedPairCollator(PAD)([_pair([5, 6], [7, 8, EOS], [7, 9, EOS]), _pair([4], [7, EOS], [7, EOS])])
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, EOS, 9, EOS], [4, 7, EOS, PAD, PAD, PAD, PAD]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4], [0, 1, 2, 0, 0, 0, 0]]
    assert b["chosen_end"].tolist() == [[0, 4], [1, 2]] and b["rejected_end"].tolist() == [[0, 6], [1, 2]]
    assert b["pair_attention"][0, 0, 6].tolist() == [True, True, True, False, False, True, True]
    assert int(b["pair_tokens"]) == (2 + 3) * 2 + (1 + 2) * 2
    with pytest.raises(ValueError, match="empty chosen or rejected"):
        PackedPairCollator(PAD)([_pair([5], [], [EOS])])


def test_pair_collator_margin():
    b = PairCollator(PAD)([_pair([5], [7, EOS], [8, EOS], margin=0.5), _pair([5], [7, EOS], [9, EOS], margin=2)])
    assert b["margin"].tolist() == [0.5, 2.0] and b["margin"].dtype == torch.float32
    with pytest.raises(ValueError, match="some examples in the batch have a margin"):
        PairCollator(PAD)([_pair([5], [7, EOS], [8, EOS], margin=0.5), _pair([5], [7, EOS], [9, EOS])])
    assert PackedPairCollator(PAD)([_pair([5], [7, EOS], [8, EOS], margin=0.5),
                                    _pair([5], [7, EOS], [9, EOS], margin=2)])["margin"].tolist() == [0.5, 2.0]


def test_prompt_collator_left_pads():
    exs = [{"prompt_ids": [5, 6, 7], "row": 3, "answer": 12, "prompt_text": "a"}, {"prompt_ids": [8], "row": 9}]
    b = PromptCollator(PAD)(exs)
    assert b["input_ids"].tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b["row"] == [3, 9] and b["answer"] == [12, None] and b["prompt_text"] == ["a", None]


def test_collators_with_real_data_and_a_dataloader(make_cfg, tokenizer):
    from rlhf_cli.data import load_preference_data, load_prompt_data

    cfg = make_cfg(max_samples=8)
    pairs = load_preference_data(cfg, tokenizer, splits=("train",)).train
    order = epoch_order(len(pairs), (0,), 0, [example_length(ex) for ex in pairs], 4)
    loader = torch.utils.data.DataLoader(pairs, batch_size=4, collate_fn=PairCollator(tokenizer.pad_token_id),
                                         sampler=order)
    batches = list(loader)
    assert [b["input_ids"].shape[0] for b in batches] == [8, 8]
    assert all(b["input_ids"].shape[1] == b["attention_mask"].sum(1).max() for b in batches)  # dynamic padding
    prompts = load_prompt_data(cfg, tokenizer)
    b = PromptCollator(tokenizer.pad_token_id)(list(prompts[:4]))
    assert (b["input_ids"][:, -1] == tokenizer(["\n"], add_special_tokens=False)["input_ids"][0][0]).all()
    assert all(isinstance(a, int) for a in b["answer"])


def test_epoch_order_grouped_by_length_is_a_seeded_permutation_with_similar_lengths():
    rng = random.Random(0)
    lengths = [rng.randint(1, 500) for _ in range(1000)]
    order = epoch_order(1000, (3,), 0, lengths, 8)
    assert sorted(order) == list(range(1000))
    assert order == epoch_order(1000, (3,), 0, lengths, 8)
    assert order != epoch_order(1000, (3,), 1, lengths, 8) and order != epoch_order(1000, (4,), 0, lengths, 8)

    def padding(o):
        return sum(max(lengths[i] for i in o[k:k + 8]) * len(o[k:k + 8]) - sum(lengths[i] for i in o[k:k + 8])
                   for k in range(0, len(o), 8))

    shuffled = list(range(1000))
    rng.shuffle(shuffled)
    assert padding(order) < padding(shuffled) / 5
    # groups are sorted inside windows of 8 groups, and the groups then shuffled: lengths do not run in order
    group_max = [max(lengths[i] for i in order[k:k + 8]) for k in range(0, 1000, 8)]
    assert group_max != sorted(group_max) and group_max != sorted(group_max, reverse=True)


def test_epoch_order_plain_shuffle_and_example_length():
    exs = [_pair([1] * i, [2], [3, 3]) for i in range(10)]
    assert example_length(exs[4]) == 6 and example_length({"prompt_ids": [1, 2]}) == 2
    order = epoch_order(10, (1,), 0)
    assert sorted(order) == list(range(10)) and order == epoch_order(10, (1,), 0) != list(range(10))
    assert epoch_order(10, (1,), 0, [example_length(ex) for ex in exs], group_size=0) == order  # no groups: plain


def _check_tries(groups, packed):
    """Each sequence reads back from its columns, at positions 0..n-1, and each of its tokens attends to exactly
    the columns of its own tokens up to it; padding attends to itself only; within a group, two sequences read
    their common first tokens from the same columns (computed once)."""
    allowed = packed.allowed[:, 0]
    for g, paths in zip(groups, packed.paths):
        assert len(paths) == len(g)
        for seq, (r, cols) in zip(g, paths):
            assert packed.input_ids[r, cols].tolist() == list(seq)
            assert packed.position_ids[r, cols].tolist() == list(range(len(seq)))
            for i, c in enumerate(cols.tolist()):
                assert allowed[r, c].nonzero().flatten().tolist() == sorted(cols[:i + 1].tolist())
        for a, (ra, ca) in zip(g, paths):
            for b, (rb, cb) in zip(g, paths):
                common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                assert ra == rb and ca[:common].tolist() == cb[:common].tolist()
    pads = (packed.attention_mask == 0).nonzero().tolist()
    for r, c in pads:
        assert allowed[r, c].nonzero().flatten().tolist() == [c]


def test_pack_tries_computes_a_shared_start_once():
    """Within a group: the prompt and the first tokens two responses share are one position each. Without
    `attention_tokens` groups never share a trie, even when they begin alike."""
    from rlhf_cli.data import pack_tries

    groups = [[[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4]], [[1, 2, 3, 9, 9]], [[7, 8]]]
    packed = pack_tries(groups, PAD)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [7, 8, PAD, PAD, PAD]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 4], [0, 1, 0, 0, 0]]
    assert packed.paths[0][0][1].tolist() == packed.paths[0][2][1].tolist() == [0, 1, 2, 3]  # a repeat: same columns
    _check_tries(groups, packed)
    with pytest.raises(ValueError, match="at least one sequence of at least one token"):
        pack_tries([[[1], []]], PAD)
    with pytest.raises(ValueError, match="at least one sequence"):
        pack_tries([[]], PAD)


def test_pack_tries_lets_groups_that_begin_alike_share_where_it_costs_less():
    from rlhf_cli.data import pack_tries
    from rlhf_cli.data.collate import MAX_GROUPS_PER_TRIE, _merge_groups

    system = list(range(10, 34))  # a chat template's system prompt: 24 tokens every prompt begins with
    g = torch.Generator().manual_seed(0)
    rnd = lambda n: torch.randint(40, 200, (n,), generator=g).tolist()  # noqa: E731
    groups = [[system + rnd(28) + rnd(32)] for _ in range(8)]  # the demo's rollouts: one response per prompt
    assert _merge_groups(groups, None) == [[i] for i in range(8)]
    runs = _merge_groups(groups, 3072)
    assert sorted(i for run in runs for i in run) == list(range(8)) and 1 < len(runs) < 8  # some share, not all
    packed = pack_tries(groups, PAD, 3072)
    _check_tries(groups, packed)
    assert int(packed.attention_mask.sum()) == 8 * 84 - 24 * (8 - len(runs))  # the system prompt once per trie
    # cheap attention: one trie, at most MAX_GROUPS_PER_TRIE groups to a trie
    assert [len(r) for r in _merge_groups(groups, 1e12)] == [8]
    assert [len(r) for r in _merge_groups([[[1] * 20 + [k]] for k in range(32)], 1e12)] == [MAX_GROUPS_PER_TRIE] * 2
    # dear attention: none share
    assert sorted(_merge_groups(groups, 1.0)) == [[i] for i in range(8)]
    # nothing shared: no trie holds two groups, whatever attention costs
    assert sorted(_merge_groups([[rnd(5)], [[1] + rnd(5)], [[2] + rnd(5)]], 1e12)) == [[0], [1], [2]]
    # a merged trie is no longer than the longest group's own (124 here), or attention_tokens / 8 (30 below)
    long = [[system + rnd(100)], *([[system[:1] + rnd(3)] for _ in range(6)])]
    runs = _merge_groups(long, 800)
    assert [0] in runs and any(len(r) > 1 for r in runs)  # short groups share; none joins the longest group
    short = [[[1] * 20 + [k, k]] for k in range(32)]  # 22 tokens each, 20 in common
    runs = _merge_groups(short, 8 * 30)
    assert max(20 + 2 * len(r) for r in runs) <= 30 and max(len(r) for r in runs) == 5


def test_pack_tries_random_groups_read_back():
    from rlhf_cli.data import pack_tries

    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        n = int(torch.randint(1, 7, (1,), generator=g))
        groups = []
        for _ in range(n):
            stem = torch.randint(3, 6, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
            groups.append([stem + torch.randint(3, 6, (int(torch.randint(1, 5, (1,), generator=g)),),
                                                generator=g).tolist() for _ in range(int(torch.randint(1, 4, (1,),
                                                                                                     generator=g)))])
        for attention_tokens in (None, 8, 1e9):
            _check_tries(groups, pack_tries(groups, PAD, attention_tokens))
