"""A lean Hugging Face tokenizer: ``tokenizer.json`` through ``tokenizers``, chat templates
through jinja2, and no torch or transformers anywhere on the import path.

Why it exists: ``transformers.AutoTokenizer`` imports torch, which makes a process that only
needs token ids (the router, a simulated engine) several hundred MB larger. This module reads the
files ``AutoTokenizer.from_pretrained(local_dir)`` reads and reproduces what transformers 5 does
with them for a ``tokenizers``-backed tokenizer: the special tokens it adds to the backend, the
chat template it picks, and how it is rendered (``engine.chat_template``).
``tests/engine/test_tokenizer.py`` holds it to transformers' output.

Not reproduced (a clear error instead of a silent difference): directories without
``tokenizer.json`` (SentencePiece / tiktoken only), tools given as Python callables, and the
``apply_chat_template`` options ``continue_final_message``, ``sanitize_control_tokens``,
``return_assistant_tokens_mask``, padding, truncation and tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from engine.chat_template import ChatTemplateError, render_chat

__all__ = ["ChatTemplateError", "Tokenizer", "load_tokenizer"]

# transformers' named special tokens, in its order (all_special_tokens lists them so).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# apply_chat_template options of transformers this module does not implement.
_UNSUPPORTED_CHAT_OPTIONS = (
    "continue_final_message",
    "sanitize_control_tokens",
    "return_assistant_tokens_mask",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
)
_NO_MAX_LENGTH = int(1e30)  # transformers' VERY_LARGE_INTEGER: "no limit configured"


# From this many characters, ``encode`` goes through the library's batch call, which releases the
# GIL (its single-text call holds it throughout: measured, a thread encoding 15 k tokens froze the
# event loop's thread for 20 ms a call; through the batch call, under 5 ms in total), so a router
# or an engine front tokenizing a long prompt in a worker thread does not stall its event loop.
# The "fast" batch call (no offsets) gives the same ids in 0.7-0.8x the time (a 60,000-character
# text: 13.5 against 18.8 ms). Shorter texts keep the single call, which holds the GIL: released
# for a moment, it can go to a background thread and the loop waits a switch interval for it back.
GIL_FREE_CHARS = 2048


def encode_batch_fast(backend, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Each text's ids through the library's batch call without offsets, which releases the GIL
    while it works (requirements.txt pins a tokenizers that has it)."""
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


class Tokenizer:
    """A model's tokenizer and chat template, with the transformers methods this project uses
    (``encode``, ``decode``, ``apply_chat_template``, the special-token attributes, ``len``).

    ``eos_token_ids`` adds what transformers keeps elsewhere: every id that ends generation
    (``generation_config.json``'s ``eos_token_id``, int or list, plus the tokenizer's eos).
    """

    def __init__(
        self,
        backend: Backend,
        special_tokens: dict[str, str],
        extra_special_tokens: list[str],
        chat_template: str | dict[str, str] | None = None,
        generation_eos_ids: tuple[int, ...] = (),
        name_or_path: str = "",
        config: dict | None = None,
    ):
        config = config or {}
        self.backend = backend
        self.special_tokens_map = special_tokens
        self.extra_special_tokens = extra_special_tokens
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self.model_max_length = config.get("model_max_length") or _NO_MAX_LENGTH
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self._attention_mask = "attention_mask" in config.get(
            "model_input_names", ("input_ids", "attention_mask")
        )
        eos = {i for i in generation_eos_ids if isinstance(i, int)}
        self.eos_token_ids = eos | ({self.eos_token_id} if self.eos_token_id is not None else set())

    # ----- special tokens ---------------------------------------------------------------------
    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    unk_token = property(lambda self: self.special_tokens_map.get("unk_token"))
    pad_token = property(lambda self: self.special_tokens_map.get("pad_token"))
    bos_token_id = property(lambda self: self._id_of(self.bos_token))
    eos_token_id = property(lambda self: self._id_of(self.eos_token))
    unk_token_id = property(lambda self: self._id_of(self.unk_token))
    pad_token_id = property(lambda self: self._id_of(self.pad_token))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.convert_tokens_to_ids(token)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # ----- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' ``vocab_size``)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """The full vocabulary with added tokens (transformers' ``len(tokenizer)``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        if not isinstance(tokens, str):
            return [self.convert_tokens_to_ids(t) for t in tokens]
        index = self.backend.token_to_id(tokens)
        if index is None and self.unk_token is not None and tokens != self.unk_token:
            return self.unk_token_id
        return index

    # ----- text <-> ids -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (a BOS, ...)
        as transformers does, and defaults to True as there."""
        if len(text) >= GIL_FREE_CHARS:  # the batch call releases the GIL while it works
            return encode_batch_fast(self.backend, [text], add_special_tokens)[0]
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return self._encoding(self.encode(text, add_special_tokens=add_special_tokens))

    def _encoding(self, ids: list[int]) -> dict[str, list[int]]:
        out = {"input_ids": ids}
        if self._attention_mask:
            out["attention_mask"] = [1] * len(ids)
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str | list[str]:
        """Text of ``ids`` (an id, a list of ids, or a batch of lists)."""
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], (list, tuple)):
            return [self.decode(list(seq), skip_special_tokens) for seq in ids]
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        # transformers refuses this WordPiece-era cleanup for BPE models (it eats real spaces)
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)
        return text

    # ----- chat -------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        conversation: list,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs,
    ):
        """Render ``conversation`` (or a batch of them) with the chat template, as transformers 5
        does: the string with ``tokenize=False``; with ``tokenize=True`` the ids, encoded without
        added special tokens, as ``{"input_ids", "attention_mask"}`` unless ``return_dict=False``.
        Extra keyword arguments are template variables. A template's ``raise_exception`` raises
        ``ChatTemplateError`` (a ``jinja2.TemplateError`` and a ``ValueError``)."""
        for option in _UNSUPPORTED_CHAT_OPTIONS:
            if kwargs.pop(option, None):
                raise ValueError(f"apply_chat_template: {option!r} is not supported here")
        template = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("Cannot apply a chat template to an empty conversation")
        batched = isinstance(conversation[0], (list, tuple))
        variables = {**self.special_tokens_map, **kwargs}
        rendered = [
            render_chat(
                template,
                chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                variables=variables,
            )
            for chat in (conversation if batched else [conversation])
        ]
        if tokenize:
            rendered = [self.encode(text, add_special_tokens=False) for text in rendered]
            if return_dict and not batched:
                return self._encoding(rendered[0])
            if return_dict:
                encodings = [self._encoding(ids) for ids in rendered]
                return {key: [e[key] for e in encodings] for key in encodings[0]}
        return rendered if batched else rendered[0]

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template to render: ``chat_template`` (a template, or the name of one of several),
        else the model's; of several, "tool_use" when there are tools, else "default"."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                f"{self.name_or_path}: several chat templates and none is 'default'; pass one "
                f"of {sorted(templates)} as chat_template"
            )
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(f"{self.name_or_path or 'this tokenizer'} has no chat template")
        return templates


def _clean_up_tokenization(text: str) -> str:
    for spaced, tight in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, tight)
    return text


# ---------------------------------------------------------------------------------------------
# Loading a model directory.


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of the local Hugging Face model directory ``path``.

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json``, the chat template files and
    ``generation_config.json``. Raises ``ValueError`` naming the path when ``tokenizer.json`` is
    missing (a SentencePiece-only model needs transformers to convert it).
    """
    root = Path(path)
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"no tokenizer.json at {tokenizer_file}: the lean tokenizer reads only the "
            "`tokenizers` serialization (save the tokenizer with a fast tokenizer to get one)"
        )
    config = _read_json(root / "tokenizer_config.json")
    backend = Backend.from_file(str(tokenizer_file))
    # transformers switches both off for every call that does not ask for them
    backend.no_truncation()
    backend.no_padding()
    named, extra = _special_tokens(config, _read_json(root / "special_tokens_map.json"))
    _add_tokens(backend, config, named, extra)
    eos = _read_json(root / "generation_config.json").get("eos_token_id")
    return Tokenizer(
        backend,
        special_tokens={k: _content(v) for k, v in named.items()},
        extra_special_tokens=list(dict.fromkeys(_content(t) for t in extra)),
        chat_template=_chat_template(root, config),
        generation_eos_ids=tuple(eos if isinstance(eos, list) else [eos]),
        name_or_path=str(path),
        config=config,
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {}


def _as_token(value, special: bool | None = None) -> str | AddedToken | None:
    """A config's token: a string, or an AddedToken dict (``{"content": ..., "lstrip": ...}``)."""
    if not isinstance(value, dict):
        return value if isinstance(value, str) else None
    fields = {k: v for k, v in value.items() if k not in ("__type", "id")}
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


def _content(token: str | AddedToken) -> str:
    return token if isinstance(token, str) else token.content


def _special_tokens(config: dict, legacy_map: dict) -> tuple[dict, list]:
    """The named special tokens (transformers' seven plus model-specific ``*_token`` keys such as
    ``image_token``) and the extra ones, as strings or AddedTokens, in transformers' order."""
    named = {key: _as_token(config.get(key)) for key in NAMED_SPECIAL_TOKENS}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if "added_tokens_decoder" not in config:  # transformers reads the legacy file only then
        for key, value in legacy_map.items():
            if key in ("extra_special_tokens", "additional_special_tokens"):
                extra = list(extra) + [t for t in value if t not in extra]
            elif key.endswith("_token"):
                named[key] = _as_token(value, special=True)
    for key, value in config.items():
        if key.endswith("_token") and key not in named and isinstance(value, str):
            named[key] = value
    if isinstance(extra, dict):  # {"image_token": "<image>"}: more named tokens
        named.update({k: _as_token(v) for k, v in extra.items()})
        extra = []
    named = {k: v for k, v in named.items() if v is not None}
    return named, [t for t in (_as_token(x, special=True) for x in extra) if t is not None]


def _add_tokens(backend: Backend, config: dict, named: dict, extra: list) -> None:
    """Add to the backend what transformers adds at load: every ``added_tokens_decoder`` entry of
    the config (by id order) and the special tokens the backend does not hold yet."""
    decoder = config.get("added_tokens_decoder") or {}
    to_add = [_as_token(decoder[k]) for k in sorted(decoder, key=int)]
    to_add = [t for t in to_add if isinstance(t, AddedToken)]
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    present |= {t.content for t in to_add}
    named_contents = {_content(v) for v in named.values()}
    for token in [*named.values(), *extra]:
        if _content(token) in present:
            continue
        present.add(_content(token))
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and token.content in named_contents:
            token = _as_token({**_token_fields(token), "special": True})
        to_add.append(token)
    if to_add:
        backend.add_tokens(to_add)


def _token_fields(token: AddedToken) -> dict:
    names = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
    return {name: getattr(token, name) for name in names}


def _chat_template(root: Path, config: dict) -> str | dict[str, str] | None:
    """Template files win over the config's entry, as in transformers: ``chat_template.jinja``
    (the default) and ``additional_chat_templates/*.jinja`` (named ones); then the config's
    ``chat_template`` (a string or ``[{"name", "template"}]``); then ``chat_template.json``."""
    templates = {}
    if (root / "chat_template.jinja").is_file():
        templates["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = config.get("chat_template")
    if value is None:
        value = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value}
    return value
