"""dsv4.engine: generation with continuous batching on the paged, compressed KV cache.

    from dsv4.engine import Engine
    Engine(model_or_checkpoint_dir, kv_format="fp32", indexer_format="fp32").generate(prompts, max_new_tokens=32)

Modules: `default_model` (the tiny random model of `dsv4 run`), `checkpoint` (loading a directory),
`model_runner` (transformers' layers around `AttentionSubBlock`, on packed tokens), `scheduler`
(admission, chunked prefill, continuous batching), `sampling`, `engine` (the API), `report`
(statistics, table), `command` (the `dsv4 run` subcommand).
"""

from dsv4.engine.engine import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]
