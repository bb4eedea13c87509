"""The project's built-in tiny model: a small random Llama plus a BPE tokenizer, built locally.

Tests and the default ``model="tiny"`` run need a real Hugging Face model without any download.
``ensure_tiny_model()`` builds one on first use into a cache directory and every later caller
loads it back through ``AutoModelForCausalLM`` / ``AutoTokenizer`` -- the very path a user's own
local model directory takes, so the engine has no "tiny" special case beyond path resolution.

What gets built (``TINY_MODEL_VERSION`` names it; bump it whenever the output changes):

* a byte-level BPE tokenizer (4096 tokens) trained on ``engine/tiny_corpus.txt.gz``, with the
  special tokens ``<|endoftext|>`` (bos), ``<|im_start|>``, ``<|im_end|>`` (eos) and ``<|pad|>``
  and a ChatML chat template. It never adds a BOS (or anything else) on its own:
  ``tokenizer(text).input_ids == tokenizer.encode(text)`` is exactly the BPE encoding of ``text``;
* a Llama (GQA: 8 query heads, 4 KV heads; 32,768 positions) of about 6.8 M float32 parameters
  whose weights are seeded Gaussians drawn by this module, not by transformers' initialisers, so
  the bytes stay the same across transformers versions. The std (0.08) is large on purpose:
  greedy top-1/top-2 logit margins then sit far above float32 noise, so tests may compare greedy
  ids with ``model.generate`` exactly.

The build is deterministic (same inputs -> byte-identical ``model.safetensors`` and
``tokenizer.json``) and safe under concurrency: one process builds under an ``fcntl`` lock into a
temporary sibling directory that is atomically renamed into place; the others wait and reuse it.

The corpus is CPython's ``pydoc_data.topics`` (Python documentation text, PSF license), written
once by::

    parts = [topics[k].strip() + "\\n" for k in sorted(topics)]
    gzip.compress("\\n".join(parts).encode(), compresslevel=9, mtime=0)

It is committed so the tokenizer does not depend on the Python patch version running the build.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# Long enough for multi-turn chat and trace workloads (a 6-turn chat with a 200-word system prompt
# reached 2,159 tokens, past v1's 2,048). RoPE has no learned positions: the weights are v1's.
MAX_POSITIONS = 32768
TINY_MODEL_VERSION = "v2"  # v2: a 32 k context (v1: 2,048); the same weights and tokenizer

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt.gz")

BOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Order matters: it fixes the ids (0..3) the trainer gives the special tokens.
SPECIAL_TOKENS = [BOS_TOKEN, IM_START_TOKEN, EOS_TOKEN, PAD_TOKEN]

VOCAB_SIZE = 4096
WEIGHT_SEED = 1234
WEIGHT_STD = 0.08

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Files whose presence marks a finished model directory (the rename makes them appear together).
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_cache_dir() -> Path:
    """The cache root: ``$DPMESH_CACHE_DIR`` if set, else ``~/.cache/dpmesh``."""
    env = os.environ.get("DPMESH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "dpmesh"


def ensure_tiny_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the built tiny model, building it first if it is missing.

    ``cache_dir`` defaults to :func:`default_cache_dir`; the model lives in
    ``<cache_dir>/tiny-llama-<TINY_MODEL_VERSION>``. Safe to call from many processes at once:
    exactly one builds, the rest block on the lock and then return the finished directory.
    """
    return _ensure(cache_dir)[0]


def ensure_tiny_bos_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny model with a tokenizer that, as Llama's do, puts its BOS (``<|endoftext|>``)
    before every text it encodes with special tokens: ``tokenizer(text).input_ids`` is
    ``[0] + tokenizer.encode(text, add_special_tokens=False)``. The same weights and chat template;
    built from :func:`ensure_tiny_model` into ``<cache_dir>/tiny-llama-<version>-bos``. For the
    tests where an engine adds the BOS (vLLM, SGLang and ours add it to a completion's text
    prompt, not to a chat's templated one), and the router must digest what the engine
    prefills."""
    base = ensure_tiny_model(cache_dir)
    name = f"tiny-llama-{TINY_MODEL_VERSION}-bos"
    return build_once(cache_dir, name, _REQUIRED_FILES, lambda out: _add_bos(base, out))[0]


def _add_bos(base: Path, out: Path) -> None:
    for child in base.iterdir():
        shutil.copyfile(child, out / child.name)
    path = out / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos = {"id": BOS_TOKEN, "type_id": 0}
    spec["post_processor"] = {
        "type": "Sequence",
        "processors": [
            spec["post_processor"],
            {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [
                    {"SpecialToken": bos},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}},
                    {"Sequence": {"id": "B", "type_id": 1}},
                ],
                "special_tokens": {
                    BOS_TOKEN: {
                        "id": BOS_TOKEN,
                        "ids": [SPECIAL_TOKENS.index(BOS_TOKEN)],
                        "tokens": [BOS_TOKEN],
                    }
                },
            },
        ],
    }
    path.write_text(json.dumps(spec, ensure_ascii=False))


def resolve_model_path(model: str) -> str:
    """Turn the engine's ``model`` setting into a local directory path.

    ``"tiny"`` builds/returns the built-in model; an existing directory containing
    ``config.json`` is returned unchanged. Anything else raises ``ValueError``: the engine never
    downloads from the Hugging Face hub.
    """
    if model == "tiny":
        return str(ensure_tiny_model())
    path = Path(model)
    if model and path.is_dir() and (path / "config.json").is_file():
        return model
    if model and path.is_dir():
        raise ValueError(
            f"model directory {model!r} has no config.json; "
            "expected a Hugging Face model saved with save_pretrained()"
        )
    raise ValueError(
        f"model {model!r} is neither 'tiny' nor an existing local model directory "
        "(hub ids are not supported: download the model and pass its directory)"
    )


# ---------------------------------------------------------------------------------------------
# Cache handling: lock, temp dir, atomic rename.


def _ensure(cache_dir: str | os.PathLike | None) -> tuple[Path, bool]:
    """Like :func:`ensure_tiny_model`, also telling whether this call did the build."""
    name = f"tiny-llama-{TINY_MODEL_VERSION}"
    path, built = build_once(cache_dir, name, _REQUIRED_FILES, build_tiny_model)
    if built:
        logger.info("built tiny model at %s", path)
    return path, built


def build_once(
    cache_dir: str | os.PathLike | None,
    name: str,
    required: tuple[str, ...],
    build: Callable[[Path], None],
) -> tuple[Path, bool]:
    """``(<cache>/<name>, whether this call built it)``: ``build(tmp)`` runs once, under an
    ``flock``, into a temporary sibling renamed into place, so concurrent callers never see a
    half-built directory; a directory holding every ``required`` file is taken as finished.
    Shared by the tiny model and its adapters (``engine.tiny_lora``)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / name
    if _is_complete(final, required):  # fast path: no lock needed once the rename has happened
        return final, False
    cache.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache / f".{name}.lock"):
        if _is_complete(final, required):  # someone else built it while we waited
            return final, False
        _clear_leftovers(cache, final, name)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(name), dir=cache))
        try:
            build(tmp)
            _make_readable(tmp)
            os.rename(tmp, final)  # atomic on one filesystem: never a half-built final dir
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, True


def _is_complete(path: Path, required: tuple[str, ...]) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in required)


def _make_readable(path: Path) -> None:
    """Give the build ordinary 755/644 modes: mkdtemp (and the weights writer) use 0700/0600,
    which would lock other users out of a shared cache directory."""
    path.chmod(0o755)
    for child in path.iterdir():
        child.chmod(0o644)


def _tmp_prefix(name: str) -> str:
    return f".{name}.tmp-"


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path):
    """Hold an exclusive ``flock`` on ``lock_path`` (the file itself is left in place)."""
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _clear_leftovers(cache: Path, final: Path, name: str) -> None:
    """Remove what a killed builder may have left; only called while holding the lock."""
    for stale in cache.glob(_tmp_prefix(name) + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():  # not complete (checked by the caller): damaged by hand, rebuild it
        logger.warning("removing incomplete directory %s", final)
        shutil.rmtree(final)


# ---------------------------------------------------------------------------------------------
# The build itself.


def build_tiny_model(out_dir: str | os.PathLike) -> None:
    """Build the tokenizer and model into ``out_dir`` (which must exist); no locking.

    Prefer :func:`ensure_tiny_model`; this is the raw, deterministic build step.
    """
    out = Path(out_dir)
    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(out)
    model = _build_model(tokenizer)
    model.save_pretrained(out, safe_serialization=True)


def _read_corpus() -> list[str]:
    """The training text, one line per item (no line-ending characters)."""
    with gzip.open(CORPUS_PATH, "rt", encoding="utf-8") as fh:
        return fh.read().splitlines()


def _train_bpe():
    """Train the raw ``tokenizers.Tokenizer`` (byte-level BPE) on the shipped corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # add_prefix_space=False keeps encode(text) a plain function of text: no hidden leading space.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no tokens
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
        show_progress=False,
    )
    tok.train_from_iterator(_read_corpus(), trainer=trainer)
    return tok


def _build_tokenizer():
    """Wrap the trained BPE in a transformers fast tokenizer with the ChatML template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START_TOKEN],
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,  # decode must not rewrite " ." and friends
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,  # GQA on purpose, so the engine's KV layout is exercised
        intermediate_size=768,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _build_model(tokenizer):
    """A ``LlamaForCausalLM`` with seeded weights and a greedy generation config."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM(_build_config(tokenizer)).to(torch.float32)
    _fill_weights(model)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        # Stop on the end of a chat turn and on the document separator alike.
        eos_token_id=[
            tokenizer.convert_tokens_to_ids(EOS_TOKEN),
            tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        ],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def _fill_weights(model) -> None:
    """Overwrite every persistent tensor from one seeded generator, in sorted-name order.

    Matrices get N(0, WEIGHT_STD^2); 1-D tensors (the RMSNorm weights -- Llama has no biases)
    get ones. Non-persistent buffers such as rotary ``inv_freq`` are not in the state dict and
    keep the values transformers computes.
    """
    import torch

    g = torch.Generator().manual_seed(WEIGHT_SEED)
    with torch.no_grad():
        for _name, tensor in sorted(model.state_dict().items()):
            if tensor.dim() >= 2:
                noise = torch.randn(tensor.shape, generator=g, dtype=torch.float32)
                tensor.copy_(noise * WEIGHT_STD)
            else:
                tensor.fill_(1.0)


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.tiny [--cache-dir DIR]``: build if needed and print the model path."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $DPMESH_CACHE_DIR or ~/.cache/dpmesh)",
    )
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.cache_dir))


if __name__ == "__main__":
    main()
