"""Trains a tiny jpaged Llama on Python's own standard-library source, saves it, serves it.

  python scripts/train_tiny.py                               # ~300 steps, a minute or two on 2 CPU cores
  python scripts/train_tiny.py --steps 1000 --hidden_size 256 --num_layers 4 --out_dir /tmp/tiny

1. Corpus: the source of a few standard-library modules (it ships with every Python).
2. Tokenizer: a byte-level BPE trained on that corpus with `tokenizers`.
3. Model: `jpaged.models.LlamaForCausalLM` from a `ModelConfig`, trained with optax AdamW on the
   dense (non-paged) forward of `jpaged.models.training` -- the very modules the engine serves.
4. Checkpoint: `jpaged.loading.orbax_checkpoint.save_checkpoint` (orbax state + config.json +
   tokenizer), then ``LLM(model=out_dir)`` restores it and generates through the paged KV cache.
"""
import importlib
import inspect
import os
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx

from jpaged import LLM, SamplingParams
from jpaged.loading.orbax_checkpoint import save_checkpoint
from jpaged.models import LlamaForCausalLM, ModelConfig
from jpaged.models.training import causal_lm_loss

F = flags.FLAGS


def define_flags():
    """The command-line flags (defined only when run as a script, so importing this module for
    `train` never clashes with another script's flags of the same name)."""
    flags.DEFINE_integer("steps", 300, "Optimizer steps")
    flags.DEFINE_integer("batch_size", 16, "Sequences per step")
    flags.DEFINE_integer("seq_len", 64, "Tokens per training sequence")
    flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate (warmup, then cosine decay)")
    flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay")
    flags.DEFINE_integer("vocab_size", 512, "BPE vocabulary size (256 byte tokens + merges + specials)")
    flags.DEFINE_integer("hidden_size", 128, "Model width")
    flags.DEFINE_integer("num_layers", 2, "Decoder layers")
    flags.DEFINE_integer("num_heads", 4, "Attention heads")
    flags.DEFINE_integer("num_kv_heads", 2, "Key/value heads (GQA)")
    flags.DEFINE_list("modules", ["textwrap", "string", "functools", "dataclasses"],
                      "Standard-library modules whose source is the corpus")
    flags.DEFINE_string("out_dir", None, "Checkpoint directory (default: a new temporary directory)")
    flags.DEFINE_string("prompt", "def ", "Prompt for the generation after training")
    flags.DEFINE_integer("max_tokens", 48, "Tokens to generate after training")
    flags.DEFINE_integer("log_every", 25, "Print the loss every N steps")
    flags.DEFINE_integer("seed", 0, "Initialization and data seed")


SPECIAL_TOKENS = ["<|endoftext|>"]


def load_corpus(modules) -> str:
    """Source text of standard-library modules, joined by the end-of-text token."""
    return SPECIAL_TOKENS[0].join(inspect.getsource(importlib.import_module(m)) for m in modules)


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained on ``text``, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0])


def model_config(tokenizer, *, hidden_size, num_layers, num_heads, num_kv_heads, max_len) -> ModelConfig:
    eos = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=len(tokenizer),
                       hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=hidden_size // num_heads,
                       max_position_embeddings=max_len, intermediate_size=4 * hidden_size, norm_eps=1e-5,
                       tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(eos,))


@nnx.jit
def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(causal_lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def train(*, steps=300, batch_size=16, seq_len=64, learning_rate=3e-3, weight_decay=0.01, vocab_size=512,
          hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
          modules=("textwrap", "string", "functools", "dataclasses"), out_dir=None, prompt="def ",
          max_tokens=48, log_every=25, seed=0, log=print) -> dict:
    """Runs the whole recipe; returns losses, the checkpoint path, the sample and timings."""
    t0 = time.perf_counter()
    text = load_corpus(modules)
    tokenizer = train_tokenizer(text, vocab_size)
    data = np.asarray(tokenizer(text)["input_ids"], np.int32)
    log(f"corpus: {len(text):,} characters of {', '.join(modules)} -> {len(data):,} tokens "
        f"(vocab {len(tokenizer)})")
    config = model_config(tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, max_len=max(512, seq_len))
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps=max(1, steps // 10),
                                                  decay_steps=max(steps, 2), end_value=learning_rate / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    losses = []
    t_train = time.perf_counter()
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
        batch = jnp.asarray(np.stack([data[s:s + seq_len + 1] for s in starts]))
        losses.append(float(train_step(model, optimizer, batch)))
        if step == 1 or step % log_every == 0 or step == steps:
            log(f"step {step:4d}  loss {losses[-1]:.3f}")
    train_s = time.perf_counter() - t_train
    first, last = losses[0], float(np.mean(losses[-min(10, len(losses)):]))
    log(f"loss {first:.3f} -> {last:.3f} (mean of the last {min(10, len(losses))} steps) "
        f"in {steps} steps, {train_s:.1f} s")

    out_dir = out_dir or tempfile.mkdtemp(prefix="jpaged_tiny_")
    path = save_checkpoint(model, out_dir, tokenizer, overwrite=True)
    log(f"saved orbax checkpoint to {path}")
    llm = LLM(model=path, num_kv_blocks=64, max_model_len=256)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]
    sample = out.outputs[0].text
    log(f"greedy sample from LLM(model={path!r}):\n{prompt}{sample}")
    return {"losses": losses, "first_loss": first, "last_loss": last, "checkpoint": path, "sample": sample,
            "sample_token_ids": out.outputs[0].token_ids, "train_seconds": train_s,
            "total_seconds": time.perf_counter() - t0}


def main(argv):
    del argv
    if not F["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    train(steps=F.steps, batch_size=F.batch_size, seq_len=F.seq_len, learning_rate=F.learning_rate,
          weight_decay=F.weight_decay, vocab_size=F.vocab_size, hidden_size=F.hidden_size,
          num_layers=F.num_layers, num_heads=F.num_heads, num_kv_heads=F.num_kv_heads, modules=F.modules,
          out_dir=F.out_dir, prompt=F.prompt, max_tokens=F.max_tokens, log_every=F.log_every, seed=F.seed)


if __name__ == "__main__":
    define_flags()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app.run(main)
