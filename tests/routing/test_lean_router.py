"""The router stays lean: its modules, its tokenizer and a chat request's digests never import
torch or transformers (transformers' AutoTokenizer alone would add hundreds of MB to the router),
and a worker whose tokenizer cannot be loaded is routed on text digests instead of failing."""

import subprocess
import sys

from apps.routing.decision.request_shape import CHUNK_CHARS, shape_request, text_digests
from apps.routing.live import LiveFleet
from engine.tiny import ensure_tiny_model

ROUTER_CODE = """
import os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
import django
django.setup()
import controlplane.asgi, apps.routing.process, apps.routing.decision.router
from apps.routing.decision.request_shape import load_tokenizer, prompt_token_ids, shape_request
body = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "How does a for statement iterate? " * 8}]}
shape = shape_request(body, True, sys.argv[1], 16)
assert len(shape.digests) >= 4 and shape.block_tokens == 16, shape.digests
ids = prompt_token_ids(body, True, load_tokenizer(sys.argv[1]))
assert shape.prompt_tokens == len(ids)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy[:10]
print("lean", len(shape.digests))
"""


def test_router_modules_and_digests_do_not_import_torch(repo_root):
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", ROUTER_CODE, str(ensure_tiny_model())],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("lean ")


def test_a_tokenizer_that_cannot_be_loaded_falls_back_to_text_digests(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    body = {"prompt": "x" * (3 * CHUNK_CHARS)}
    shape = shape_request(body, False, str(tmp_path), 16)
    assert shape.digests == text_digests(body["prompt"])
    assert shape.block_tokens == CHUNK_CHARS // 4


def test_a_workers_tokenizer_is_loaded_when_it_is_discovered_not_at_its_first_request():
    from apps.replicas.models import Worker
    from apps.routing.decision.config import RouterConfig
    from apps.routing.decision.request_shape import load_tokenizer, tokenizer_or_none
    from apps.routing.decision.router import Router
    from engine.digests import SCHEME

    path = str(ensure_tiny_model())
    tokenizer_or_none.cache_clear()
    load_tokenizer.cache_clear()
    info = {"dp_size": 2, "model_id": "tiny", "model_path": path, "block_size": 16,
            "prefix_digest": SCHEME, "num_kv_blocks_per_rank": 64}  # fmt: skip
    worker = Worker(id=1, url="http://127.0.0.1:9", dp_size=2, model_id="tiny", server_info=info)
    LiveFleet(Router(RouterConfig(dp_aware=True))).worker_saved(worker, {})
    assert tokenizer_or_none.cache_info().currsize == 1  # loaded with the worker
    before = load_tokenizer.cache_info().misses
    shape_request({"prompt": "hello " * 40}, False, path, 16)
    assert load_tokenizer.cache_info().misses == before  # the request found it loaded
