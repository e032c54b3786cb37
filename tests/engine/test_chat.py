"""Chat templates (jpaged/chat.py) and LLM.chat."""
import pytest

from conftest import byte_tokenizer
from jpaged import LLM, SamplingParams
from jpaged.engine.chat_template import apply_chat_template

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_template_given_or_from_tokenizer_config(tmp_path):
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="chat_template"):
        apply_chat_template(tok, CONVERSATION)  # the byte tokenizer has none
    prompt = apply_chat_template(tok, CONVERSATION, TEMPLATE)
    assert prompt["prompt"] == "[system] Be brief.\n[user] Hi!\n[assistant] "
    assert prompt["prompt_token_ids"] == list(prompt["prompt"].encode())  # no special tokens added again
    assert apply_chat_template(tok, CONVERSATION, TEMPLATE, add_generation_prompt=False)["prompt"].endswith("Hi!\n")

    from transformers import AutoTokenizer

    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path)  # written to the tokenizer's config, read back by AutoTokenizer
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert apply_chat_template(loaded, CONVERSATION) == prompt


def test_bad_conversations_raise_value_error():
    tok = byte_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i!"}]}]
    assert apply_chat_template(tok, parts, TEMPLATE)["prompt"] == "[user] Hi!\n[assistant] "
    for bad, field in (([], "messages"), ([{"content": "x"}], r"messages\[0\]"),
                       ([{"role": "robot", "content": "x"}], "role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "content"),
                       ([{"role": "user", "content": 3}], "content")):
        with pytest.raises(ValueError, match=field):
            apply_chat_template(tok, bad, TEMPLATE)
    with pytest.raises(ValueError, match="no tokenizer"):
        apply_chat_template(None, CONVERSATION, TEMPLATE)
    with pytest.raises(ValueError, match="chat_template"):
        apply_chat_template(tok, CONVERSATION, "{% if %}")  # a broken template


def test_llm_chat(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat(CONVERSATION, params, use_tqdm=False)
    one = llm.chat(CONVERSATION, params, chat_template=TEMPLATE, use_tqdm=False)
    rendered = "[system] Be brief.\n[user] Hi!\n[assistant] "
    assert len(one) == 1 and one[0].prompt == rendered
    assert one[0].outputs[0].token_ids == llm.generate([rendered], params, use_tqdm=False)[0].outputs[0].token_ids
    other = [{"role": "user", "content": "Another one"}]
    two = llm.chat([CONVERSATION, other], params, chat_template=TEMPLATE, use_tqdm=False)
    assert [o.prompt for o in two] == [rendered, "[user] Another one\n[assistant] "]
    assert two[0].outputs[0].text == one[0].outputs[0].text
    with pytest.raises(ValueError, match=r"messages\[1\].*role"):
        llm.chat([CONVERSATION, [{"role": "nobody", "content": "x"}]], params, chat_template=TEMPLATE)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


@pytest.mark.slow
def test_default_model_chat_uses_the_gguf_template():
    """The embedded GGUF's own template (from its metadata): the issue's new user gets Paris."""
    try:
        from jpaged.loading.gguf_loader import default_model_path
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(max_num_seqs=4, max_model_len=512)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "<|im_start|>assistant" in out.prompt  # SmolLM2's ChatML template came from the GGUF metadata
    assert "Paris" in out.outputs[0].text
