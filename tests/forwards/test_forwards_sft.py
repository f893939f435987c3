"""`forwards.response_logprobs`, train-sft's forward: the log-probs of demonstrations' response tokens from one
forward over a padded or packed batch, against each demonstration run alone, unpadded, through the plain model; the
SFT loss (Σ NLL of response tokens / their count) against the plain-torch loss over response tokens only, and its
gradient, which no prompt or template token's prediction contributes to."""

import pytest
import torch
from stage_helpers import assert_same_gradients, grads

from rlhf_cli.data import PackedSFTCollator, SFTCollator
from rlhf_cli.forwards import response_logprobs

PAD, EOS = 0, 2
# (prompt tokens, [(context tokens, response tokens) of each later turn], first response tokens); some begin alike
SHAPES = [(5, 3, []), (9, 1, [(4, 2)]), (3, 6, []), (12, 2, [(3, 3), (2, 1)]), (5, 4, [])]
LAYOUTS = ["padded", "packed", "packed-wide-rows"]


def make_demos(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731 (ids 0-2 are pad/bos/eos)
    system = rnd(4)
    demos = []
    for i, (p, r, later) in enumerate(SHAPES):
        prompt = (system if i % 2 else []) + rnd(p)
        ids, mask = prompt + rnd(r - 1) + [EOS], [0] * len(prompt) + [1] * r
        for c, n in later:
            ids, mask = ids + rnd(c) + rnd(n - 1) + [EOS], mask + [0] * c + [1] * n
        demos.append({"input_ids": ids, "loss_mask": mask, "row": i + 1})
    demos[-1]["input_ids"][:len(demos[0]["input_ids"]) - 3] = demos[0]["input_ids"][:-3]  # shares a long prefix
    return demos


def collate(demos, layout):
    if layout.startswith("packed"):
        return PackedSFTCollator(PAD, 1e9 if layout == "packed-wide-rows" else None)(demos)
    return SFTCollator(PAD)(demos)


def plain_token_nll(model, demo):
    """The plain loop: one unpadded demonstration, (n - 1,) NLL of every next token, and the (n - 1,) bool mask of
    the response tokens among them."""
    ids = torch.tensor([demo["input_ids"]])  # (1, n)
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)  # (n - 1, V)
    return -logp.gather(-1, ids[0, 1:, None])[:, 0], torch.tensor(demo["loss_mask"][1:]).bool()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_equal_each_demonstration_run_alone(tiny_causal, layout):
    demos = make_demos(tiny_causal.config.vocab_size)
    with torch.no_grad():
        got = response_logprobs(tiny_causal, collate(demos, layout), "fp32")
        want = torch.cat([-nll[mask] for nll, mask in (plain_token_nll(tiny_causal, d) for d in demos)])
    assert got.dtype == torch.float32 and got.shape == want.shape == (sum(sum(d["loss_mask"]) for d in demos),)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_loss_and_its_gradient_are_plain_torch_over_response_tokens_only(tiny_causal):
    """The SFT loss equals −Σ log π over response tokens / their count computed by plain torch, with the same
    gradient; the plain loss over every next token has another gradient, so what the prompt and template tokens'
    predictions would add is absent: they get zero gradient."""
    demos = make_demos(tiny_causal.config.vocab_size, seed=1)
    tiny_causal.zero_grad()
    lp = response_logprobs(tiny_causal, collate(demos, "packed"), "fp32")
    loss = -lp.sum() / lp.numel()
    loss.backward()
    ours = grads(tiny_causal)

    tiny_causal.zero_grad()
    terms = [plain_token_nll(tiny_causal, d) for d in demos]
    want = torch.cat([nll[mask] for nll, mask in terms]).sum() / sum(int(mask.sum()) for _, mask in terms)
    want.backward()
    plain = grads(tiny_causal)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert_same_gradients(ours, plain, rel=1e-5)

    tiny_causal.zero_grad()
    every = torch.cat([plain_token_nll(tiny_causal, d)[0] for d in demos]).mean()  # prompt tokens as targets too
    every.backward()
    with_prompt = grads(tiny_causal)
    tiny_causal.zero_grad()
    head = "lm_head.weight" if "lm_head.weight" in ours else next(iter(ours))
    assert float((with_prompt[head] - ours[head]).abs().max()) > 1e-3 * float(ours[head].abs().max())


def test_prompt_and_template_positions_get_exactly_zero_gradient(tiny_causal):
    """The trunk's last hidden state at a position feeds only that position's logits, so its gradient is the
    loss's gradient through that prediction: exactly 0 where the next token is prompt or template text (or there
    is none), non-zero where it is a response token."""
    demos = make_demos(tiny_causal.config.vocab_size, seed=3)
    batch = collate(demos, "padded")
    seen = {}

    def keep(module, inputs, output):
        output.retain_grad()
        seen["hidden"] = output

    handle = tiny_causal.model.norm.register_forward_hook(keep)
    try:
        tiny_causal.zero_grad()
        lp = response_logprobs(tiny_causal, batch, "fp32")
        (-lp.sum() / lp.numel()).backward()
    finally:
        handle.remove()
        tiny_causal.zero_grad()
    g = seen["hidden"].grad.abs().amax(-1)  # (B, L)
    for b, d in enumerate(demos):
        predicts_response = torch.tensor(d["loss_mask"][1:] + [0]).bool()  # position t predicts token t + 1
        n = len(d["input_ids"])
        assert (g[b, :n][~predicts_response] == 0).all() and (g[b, n:] == 0).all()
        assert (g[b, :n][predicts_response] > 0).all()


def test_padded_and_packed_give_the_same_gradients(tiny_causal):
    demos = make_demos(tiny_causal.config.vocab_size, seed=2)
    out = {}
    for layout in LAYOUTS:
        tiny_causal.zero_grad()
        lp = response_logprobs(tiny_causal, collate(demos, layout), "fp32")
        (-lp.sum() / lp.numel()).backward()
        out[layout] = grads(tiny_causal)
    tiny_causal.zero_grad()
    assert_same_gradients(out["packed"], out["padded"], rel=1e-5)
    assert_same_gradients(out["packed-wide-rows"], out["padded"], rel=1e-5)
