"""What discovery reads of a worker's LoRA adapters, and the routing view it becomes: vLLM lists
each adapter in /v1/models with the base model as its ``parent``; our engine says them in
/server_info ``lora_modules``. Pure functions, no server."""

from apps.replicas.discovery import vllm_info
from apps.routing.records import lora_adapters

METRICS = 'vllm:cache_config_info{block_size="32",num_gpu_blocks="512"} 1.0\n'


def test_vllm_adapters_come_from_the_model_entries_with_a_parent():
    models = [
        {"id": "sql", "root": "/adapters/sql", "parent": "tiny"},  # vLLM may list one first
        {"id": "tiny", "root": "/models/tiny", "parent": None, "max_model_len": 2048},
        {"id": "poems", "root": "/adapters/poems", "parent": "tiny"},
    ]
    info = vllm_info(models, METRICS, None)
    assert info["model_id"] == "tiny" and info["model_path"] == "/models/tiny"
    assert info["lora_modules"] == [
        {"name": "sql", "path": "/adapters/sql"},
        {"name": "poems", "path": "/adapters/poems"},
    ]
    assert lora_adapters(info) == {"sql", "poems"}
    plain = vllm_info(models[1:2], METRICS, None)
    assert "lora_modules" not in plain and lora_adapters(plain) == frozenset()


def test_our_engines_lora_modules_read_as_names_or_entries():
    info = {"lora_modules": [{"name": "sql", "path": "/a"}, "poems", {"path": "/nameless"}, 3]}
    assert lora_adapters(info) == {"sql", "poems"}
