"""Every kernel lowers for real hardware from a CPU-only host.

``jax.export`` lowers for the named platform without a device: TPU must yield
a Mosaic ``tpu_custom_call`` and CUDA a Triton custom call, and neither may be
the plain-XLA reference (no gather/scatter/while ops from ``reference.py``).
Lowering stops at the custom call's payload; the Mosaic and Triton compilers
themselves only run on the device.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk

CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
# Ops that only the XLA references emit.
FALLBACK_OPS = ("stablehlo.gather", "stablehlo.scatter", "stablehlo.while")

# (num_kv_heads, group, head_dim, block_size, dtype): a GQA bf16 config and a
# SmolLM2-like one (3 kv heads, group 3, head_dim 64).
CONFIGS = {"gqa_bf16": (2, 4, 128, 16, jnp.bfloat16),
           "smollm_f32": (3, 3, 64, 16, jnp.float32)}


def _inputs(num_kv_heads, group, head_dim, block_size, dtype,
            num_tokens=40, max_seqs=6, num_blocks=64, max_blocks=12):
  s = jax.ShapeDtypeStruct
  i32 = jnp.int32
  return dict(
      q_decode=s((max_seqs, num_kv_heads * group, head_dim), dtype),
      q=s((num_tokens, num_kv_heads * group, head_dim), dtype),
      pages=s((num_kv_heads, num_blocks, block_size, head_dim), dtype),
      new=s((num_tokens, num_kv_heads, head_dim), dtype),
      tables=s((max_seqs, max_blocks), i32), lens=s((max_seqs,), i32),
      qsl=s((max_seqs + 1,), i32), num_seqs=s((1,), i32),
      slots=s((num_tokens,), i32), ids=s((5,), i32))


def _calls(x):
  scale = 0.125
  return {
      "paged_attention": (
          functools.partial(pk.paged_attention, scale=scale),
          (x["q_decode"], x["pages"], x["pages"], x["tables"], x["lens"]), {}),
      "ragged_paged_attention": (
          functools.partial(pk.ragged_paged_attention, scale=scale),
          (x["q"], x["pages"], x["pages"], x["tables"], x["lens"], x["qsl"],
           x["num_seqs"]), {}),
      "write_kv": (pk.write_kv, (x["pages"], x["pages"], x["new"], x["new"],
                                 x["slots"]), dict(donate_argnums=(0, 1))),
      "copy_blocks": (pk.copy_blocks, (x["pages"], x["pages"], x["ids"],
                                       x["ids"]), dict(donate_argnums=(0, 1))),
  }


def _export(fn, args, jit_kw, platform, **kw):
  return jax.export.export(jax.jit(fn, **jit_kw), platforms=[platform],
                           **kw)(*args)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", ["paged_attention", "ragged_paged_attention",
                                  "write_kv", "copy_blocks"])
def test_lowers_to_kernel(name, config, platform):
  """Auto backend picks the Pallas kernel when lowering for TPU / CUDA."""
  fn, args, jit_kw = _calls(_inputs(*CONFIGS[config]))[name]
  exported = _export(fn, args, jit_kw, platform,
                     disabled_checks=pk.EXPORT_DISABLED_CHECKS)
  text = exported.mlir_module()
  assert CUSTOM_CALL[platform] in text
  for op in FALLBACK_OPS:
    assert op not in text, f"{name} on {platform} fell back to XLA ({op})"
  if name in ("write_kv", "copy_blocks"):  # pools alias the outputs
    assert text.count("tf.aliasing_output") == 2


@pytest.mark.parametrize("name", ["paged_attention", "write_kv"])
def test_tpu_export_needs_no_disabled_checks(name):
  fn, args, jit_kw = _calls(_inputs(*CONFIGS["gqa_bf16"]))[name]
  assert "tpu_custom_call" in _export(fn, args, jit_kw, "tpu").mlir_module()


def test_cuda_export_only_flags_the_triton_call():
  """Triton is not on jax.export's stable custom-call list; that is the only
  reason CUDA export needs ``EXPORT_DISABLED_CHECKS``."""
  fn, args, jit_kw = _calls(_inputs(*CONFIGS["gqa_bf16"]))["paged_attention"]
  with pytest.raises(ValueError, match=r"__gpu\$xla\.gpu\.triton"):
    _export(fn, args, jit_kw, "cuda")


def test_cpu_lowering_is_reference():
  fn, args, jit_kw = _calls(_inputs(*CONFIGS["gqa_bf16"]))["write_kv"]
  text = _export(fn, args, jit_kw, "cpu").mlir_module()
  assert "stablehlo.scatter" in text and "custom_call" not in text
