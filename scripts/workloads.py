"""The benchmark workloads: seeded request sets (prompt token ids, output lengths), numpy only.

Three shapes, all random token ids (the model is random too, so only lengths matter):

  fixed          32 prompts of 128 tokens, 128 output tokens each;
  sharegpt-like  the vLLM paper's ShareGPT shape without the data set: prompt and output lengths
                 log-normal with means ~161 and ~338 tokens (long, high variance), 200 requests;
  alpaca-like    Alpaca's shape: means ~19 and ~58 tokens (short, less variance), 500 requests.

Lengths are drawn before clipping, so the clipped means are a little lower. The same ``seed`` gives
the same requests in every run and for every engine measured against them.
"""
from dataclasses import dataclass

import numpy as np

FIRST_TOKEN_ID = 3  # ids 0-2 are pad / bos / eos in bench-llama


@dataclass(frozen=True)
class LogNormal:
    """Lengths whose distribution has mean ``mean`` (before clipping to [lo, hi])."""
    mean: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = np.log(self.mean) - self.sigma ** 2 / 2  # E[exp(N(mu, sigma))] = exp(mu + sigma^2 / 2)
        return np.clip(rng.lognormal(mu, self.sigma, n).astype(np.int64), self.lo, self.hi)


# name -> (default number of requests, prompt lengths, output lengths); an int is a fixed length
WORKLOADS = {
    "fixed": (32, 128, 128),
    "sharegpt-like": (200, LogNormal(161, 1.0, 4, 1024), LogNormal(338, 0.9, 4, 1024)),
    "alpaca-like": (500, LogNormal(19, 0.6, 4, 256), LogNormal(58, 0.8, 4, 512)),
}


def _lengths(spec, rng: np.random.Generator, n: int) -> np.ndarray:
    return np.full(n, spec, np.int64) if isinstance(spec, int) else spec.sample(rng, n)


def make_workload(name: str, vocab_size: int, num_requests: int | None = None, seed: int = 0,
                  length_scale: float = 1.0) -> tuple[list[list[int]], list[int]]:
    """(prompts as token id lists, output lengths) of workload ``name``.

    ``length_scale`` multiplies every prompt and output length (at least 1 token each) after the
    draw, keeping the shape of the distribution, so that a CPU finishes in minutes.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload={name!r}: not one of {sorted(WORKLOADS)}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests={num_requests}: must be >= 1")
    if not length_scale > 0:
        raise ValueError(f"length_scale={length_scale}: must be > 0")
    default_n, prompt_spec, output_spec = WORKLOADS[name]
    n = num_requests or default_n
    rng = np.random.default_rng(seed)
    prompt_lens = _lengths(prompt_spec, rng, n)
    output_lens = _lengths(output_spec, rng, n)
    prompts = [rng.integers(FIRST_TOKEN_ID, vocab_size, int(k)).tolist() for k in prompt_lens]
    outputs = [int(k) for k in output_lens]
    if length_scale != 1.0:
        prompts = [p[:max(1, round(len(p) * length_scale))] for p in prompts]
        outputs = [max(1, round(k * length_scale)) for k in outputs]
    return prompts, outputs
