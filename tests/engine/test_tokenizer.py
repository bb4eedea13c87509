"""The lean tokenizer (engine.tokenizer) against transformers' AutoTokenizer on the same model
directory: same ids, same text, same special tokens, same rendered chat templates (strings and
ids), same template errors; and it never imports torch or transformers."""

import json
import shutil
import subprocess
import sys

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from engine.chat_template import compile_chat_template
from engine.tiny import ensure_tiny_model
from engine.tokenizer import load_tokenizer
from tests.engine.chat_templates import TEMPLATES

TEXTS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x ** 2  # squares\n\n\n",
    "   leading and trailing   ",
    "tabs\t\tand\n\nnewlines \r\n mixed",
    "unicode: café, naïve, 東京, Ελληνικά, emoji 🙂🚀👩‍💻, combining e\u0301",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|pad|> <|im_end|>tail",
    "a" * 300 + " " + "xyz " * 50,
]

SYSTEM = {"role": "system", "content": "You are a careful assistant. Réponds brièvement 🙂."}
USER = {"role": "user", "content": "How does a for statement iterate?"}
ASSISTANT = {"role": "assistant", "content": "It asks for an iterator and calls next()."}
USER2 = {"role": "user", "content": "And  with\ttabs,\n\nnewlines and <|im_end|> inside?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city (°C) — e.g. São Paulo",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time <UTC> & date"}},
]
TOOL_CALL = {
    "role": "assistant",
    "content": None,  # as OpenAI clients send it: the key is dropped before rendering
    "tool_calls": [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
        }
    ],
}
TOOL_CHAT = [
    SYSTEM,
    {"role": "user", "content": "What is the weather in Zürich?"},
    TOOL_CALL,
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "tool", "content": '{"humidity": "40%"}'},
]
PARTS_CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in"},
            {"type": "image", "image": "a.png"},
            {"type": "text", "text": "this picture?"},
        ],
    },
    {"role": "assistant", "content": [{"type": "text", "text": "A cat 🐈."}]},
    {"role": "user", "content": "And the colour?"},
]
REASONING_CHAT = [
    SYSTEM,
    USER,
    {"role": "assistant", "content": "\nIt iterates.", "reasoning_content": "think first"},
    {"role": "user", "content": "Why?"},
    {"role": "assistant", "content": "Because.", "reasoning": "alias name"},
]
DATE = {"date_string": "26 Jul 2024"}  # Llama's template would read the clock otherwise

# (template, conversation, tools, extra template variables)
CHAT_CASES = {
    "tiny-plain": ("tiny", [SYSTEM, USER, ASSISTANT, USER2], None, {}),
    "tiny-special-text": ("tiny", [{"role": "user", "content": TEXTS[6] + TEXTS[5]}], None, {}),
    "llama-plain": ("llama31", [SYSTEM, USER, ASSISTANT, USER2], None, DATE),
    "llama-tools": ("llama31", TOOL_CHAT, TOOLS, DATE),
    "llama-tools-in-system": (
        "llama31",
        TOOL_CHAT,
        TOOLS,
        {**DATE, "tools_in_user_message": False},
    ),
    "qwen25-plain": ("qwen25", [USER, ASSISTANT, USER2], None, {}),
    "qwen25-tools": ("qwen25", TOOL_CHAT, TOOLS, {}),
    "qwen3-reasoning": ("qwen3", REASONING_CHAT, None, {}),
    "qwen3-no-thinking": ("qwen3", [SYSTEM, USER], None, {"enable_thinking": False}),
    "mistral": ("mistral", [USER, ASSISTANT, USER2], None, {}),
    "gemma": ("gemma", [USER, ASSISTANT, USER2], None, {}),
    "parts": ("parts", PARTS_CHAT, None, {}),
    "tojson": ("tojson", [TOOL_CALL, {"role": "user", "content": "<b> & é"}], None, {}),
}


def transformers_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny_dir():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def make_dir(tiny_dir, tmp_path_factory):
    """A model directory: the tiny model's tokenizer with config changes and template files."""

    def make(config=None, files=None, backend=None):
        out = tmp_path_factory.mktemp("tok")
        for name in ("tokenizer.json", "generation_config.json", "config.json"):
            shutil.copy(tiny_dir / name, out / name)
        merged = json.loads((tiny_dir / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**merged, **(config or {})}))
        for name, text in (files or {}).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_text(text)
        if backend is not None:
            backend.save(str(out / "tokenizer.json"))
        return out

    return make


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return load_tokenizer(str(tiny_dir)), transformers_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def template_pairs(make_dir, tiny_dir):
    """Per template: (lean, transformers) over a directory whose template file is replaced."""
    added = {  # the control tokens of the templates above, so they encode as single tokens
        str(4096 + i): {"content": tok, "special": True, "normalized": False}
        for i, tok in enumerate(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    }
    pairs = {"tiny": (load_tokenizer(str(tiny_dir)), transformers_tokenizer(tiny_dir))}
    for name, template in TEMPLATES.items():
        path = make_dir({"added_tokens_decoder": added}, {"chat_template.jinja": template})
        pairs[name] = (load_tokenizer(str(path)), transformers_tokenizer(path))
    return pairs


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_transformers(pair, text, add_special_tokens):
    lean, hf = pair
    assert lean.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
        text, add_special_tokens=add_special_tokens
    )


@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_transformers(pair, skip):
    lean, hf = pair
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )
    arbitrary = [(7 * i + 3) % len(hf) for i in range(200)] + [0, 1, 2, 3]
    assert lean.decode(arbitrary, skip) == hf.decode(arbitrary, skip_special_tokens=skip)
    assert lean.decode(2) == hf.decode(2)


def test_vocabulary_and_special_tokens_match(pair):
    lean, hf = pair
    assert (len(lean), lean.vocab_size) == (len(hf), hf.vocab_size)
    for name in ("bos", "eos", "pad", "unk"):
        assert getattr(lean, f"{name}_token") == getattr(hf, f"{name}_token")
        assert getattr(lean, f"{name}_token_id") == getattr(hf, f"{name}_token_id")
    assert lean.all_special_ids == hf.all_special_ids
    assert lean.chat_template == hf.chat_template
    assert lean.eos_token_ids == {0, 2}  # generation_config's [2, 0] plus the tokenizer's eos


def test_config_tokens_are_added_like_transformers(make_dir):
    """Tokens named in tokenizer_config.json but absent from tokenizer.json join the vocabulary
    (len grows) with the special flags transformers gives them."""
    path = make_dir(
        {
            "added_tokens_decoder": {
                "4096": {"content": "<tool_call>", "special": False, "normalized": False},
                "4097": {"content": "<|eot_id|>", "special": True, "normalized": False},
            },
            "bos_token": "<|begin_of_text|>",  # in neither file: transformers adds it as special
            "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": True},
            "image_token": "<|image|>",  # a model-specific special token
        }
    )
    lean, hf = load_tokenizer(str(path)), transformers_tokenizer(path)
    assert len(lean) == len(hf) == 4096 + 4
    assert (lean.bos_token_id, lean.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert lean.special_tokens_map == hf.special_tokens_map
    text = "<|begin_of_text|>call <tool_call>x</tool_call><|image|> done<|eot_id|>"
    ids = hf.encode(text, add_special_tokens=False)
    assert lean.encode(text, add_special_tokens=False) == ids
    for skip in (False, True):
        assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )


def test_add_special_tokens_applies_the_post_processor(make_dir, tiny_dir):
    backend = Backend.from_file(str(tiny_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>",
        pair="<|endoftext|> $A $B",
        special_tokens=[("<|endoftext|>", 0), ("<|im_end|>", 2)],
    )
    path = make_dir(backend=backend)
    lean, hf = load_tokenizer(str(path)), transformers_tokenizer(path)
    for text in TEXTS[:4]:
        with_bos = lean.encode(text, add_special_tokens=True)
        assert with_bos == hf.encode(text, add_special_tokens=True)
        assert with_bos[0] == 0 and with_bos[-1] == 2
        assert lean.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )


def test_legacy_special_tokens_map_overrides_the_config(make_dir):
    path = make_dir(files={"special_tokens_map.json": json.dumps({"pad_token": "<|endoftext|>"})})
    lean, hf = load_tokenizer(str(path)), transformers_tokenizer(path)
    assert lean.pad_token == hf.pad_token == "<|endoftext|>"
    assert lean.pad_token_id == hf.pad_token_id == 0


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(template_pairs, case, add_generation_prompt):
    name, chat, tools, variables = CHAT_CASES[case]
    lean, hf = template_pairs[name]
    kwargs = dict(tools=tools, add_generation_prompt=add_generation_prompt, **variables)
    text = lean.apply_chat_template(chat, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(chat, tokenize=False, **kwargs)
    assert lean.apply_chat_template(chat, **kwargs) == dict(hf.apply_chat_template(chat, **kwargs))
    ids = lean.apply_chat_template(chat, return_dict=False, **kwargs)
    assert ids == hf.apply_chat_template(chat, return_dict=False, **kwargs)
    assert ids == lean.encode(text, add_special_tokens=False)


def test_a_batch_of_conversations_matches_transformers(template_pairs):
    lean, hf = template_pairs["qwen25"]
    batch = [[USER, ASSISTANT], [SYSTEM, USER2]]
    assert lean.apply_chat_template(batch, tokenize=False) == hf.apply_chat_template(
        batch, tokenize=False
    )
    assert lean.apply_chat_template(batch) == dict(hf.apply_chat_template(batch))


@pytest.mark.parametrize(
    "name, chat",
    [
        ("mistral", [USER, USER2]),
        ("mistral", [SYSTEM, USER]),
        ("gemma", [SYSTEM, USER]),
        ("llama31", [SYSTEM]),  # tools in the first user message, and there is none
    ],
)
def test_raise_exception_raises_like_transformers(template_pairs, name, chat):
    lean, hf = template_pairs[name]
    kwargs = {"tools": TOOLS, **DATE} if name == "llama31" else {}
    with pytest.raises(jinja2.TemplateError) as theirs:
        hf.apply_chat_template(chat, tokenize=False, **kwargs)
    with pytest.raises(jinja2.TemplateError) as ours:
        lean.apply_chat_template(chat, tokenize=False, **kwargs)
    assert isinstance(ours.value, ValueError)
    assert str(ours.value) == str(theirs.value)


def test_named_templates_pick_tool_use_with_tools(make_dir):
    templates = [
        {"name": "default", "template": "{{ 'default:' + messages[0]['content'] }}"},
        {"name": "tool_use", "template": "{{ 'tools:' + tools | length | string }}"},
    ]
    path = make_dir({"chat_template": templates})
    (path / "chat_template.jinja").unlink(missing_ok=True)
    lean, hf = load_tokenizer(str(path)), transformers_tokenizer(path)
    for tools in (None, TOOLS):
        assert lean.apply_chat_template([USER], tools=tools, tokenize=False) == (
            hf.apply_chat_template([USER], tools=tools, tokenize=False)
        )
    assert lean.apply_chat_template([USER], tools=TOOLS, tokenize=False) == "tools:2"


def test_template_files_win_over_the_config(make_dir):
    path = make_dir(
        {"chat_template": "config"},
        {"chat_template.jinja": "file", "additional_chat_templates/short.jinja": "{{ 'short' }}"},
    )
    lean, hf = load_tokenizer(str(path)), transformers_tokenizer(path)
    assert lean.chat_template == hf.chat_template == {"default": "file", "short": "{{ 'short' }}"}
    assert lean.apply_chat_template([USER], chat_template="short", tokenize=False) == "short"


def test_chat_template_json_is_read_when_nothing_else_has_one(make_dir, tiny_dir):
    template = (tiny_dir / "chat_template.jinja").read_text()
    path = make_dir(files={"chat_template.json": json.dumps({"chat_template": template})})
    lean, hf = load_tokenizer(str(path)), transformers_tokenizer(tiny_dir)
    assert lean.apply_chat_template([USER], tokenize=False) == hf.apply_chat_template(
        [USER], tokenize=False
    )


def test_strftime_now_renders_todays_date(template_pairs):
    from datetime import datetime

    lean, hf = template_pairs["llama31"]
    text = lean.apply_chat_template([USER], tokenize=False)
    assert f"Today Date: {datetime.now():%d %b %Y}" in text
    assert text == hf.apply_chat_template([USER], tokenize=False)  # same day, same output


def test_templates_compile_once():
    template = "{{ messages | length }}"
    assert compile_chat_template(template) is compile_chat_template(template)


def test_unsupported_options_and_missing_files_are_clear_errors(pair, tmp_path):
    lean, _ = pair
    with pytest.raises(ValueError, match="continue_final_message"):
        lean.apply_chat_template([USER], continue_final_message=True)
    with pytest.raises(ValueError, match="empty conversation"):
        lean.apply_chat_template([])
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json")):
        load_tokenizer(str(tmp_path))


def test_no_torch_and_no_transformers_are_imported(tiny_dir, repo_root):
    code = (
        "import sys\n"
        "from engine.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer(sys.argv[1])\n"
        "assert tok.encode('hello world', add_special_tokens=False)\n"
        "text = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,\n"
        "                               add_generation_prompt=True)\n"
        "assert text.endswith('assistant\\n'), text\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_dir)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
