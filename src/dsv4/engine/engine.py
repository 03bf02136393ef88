"""Engine: continuous-batching generation of a DeepSeek-V4 model on the paged, compressed cache.

    from dsv4.engine import Engine
    eng = Engine(model_or_checkpoint_dir, kv_format="fp8_ds", memory_bytes=2**30, max_batch_tokens=2048)
    new_ids = eng.generate([[0, 17, 42], [0, 5]], max_new_tokens=64)          # greedy
    new_ids = eng.generate(prompts, max_new_tokens=64, temperature=0.8, top_p=0.95, seed=1)
    result = eng.run(prompts, max_new_tokens=64)                               # + stats, finish reasons

An in-memory `DeepseekV4ForCausalLM` is patched in place (its attention modules are replaced by
`AttentionSubBlock`s holding the same weights) and is afterwards only usable through the engine.

Cache options are `KVCacheManager`'s: kv_format, indexer_format, tokens_per_block, num_blocks or
memory_bytes, max_requests, device, backend (kernels: "auto" = Triton on CUDA when installed, else the
PyTorch reference). With neither num_blocks nor memory_bytes, each call gets a
cache sized to hold its `max_requests` largest requests at once (nothing is then rejected).
`fp8_weights=True` holds the attention projections DeepSeek-V4 checkpoints ship in FP8 as FP8
blocks (`dsv4.model.fp8_weights`): quantised from the model's weights where they are dense; an FP8
checkpoint's own codes and scales are kept either way.

A request that could never fit in the cache is rejected: generate() returns [] for it and serves
the others; `run()` reports it. Only when every request is rejected does the call raise
(`OutOfBlocksError`), since then nothing can be served.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.cache.manager import KVCacheManager
from dsv4.cache.schema import block_fill_ratio, blocks_needed, build_schemas
from dsv4.engine.checkpoint import load_checkpoint
from dsv4.engine.model_runner import (
    ModelRunner,
    cast_like_transformers,
    check_patchable,
    match_pinned_norms,
    patch_attention,
    weights_label,
)
from dsv4.engine.report import RunStats, StatsRecorder
from dsv4.engine.sampling import check_sampling, request_generator, sample
from dsv4.engine.scheduler import Request, Scheduler, Status
from dsv4.errors import CheckpointError, ConfigError, InputError, OutOfBlocksError
from dsv4.model.config import DSV4Config


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationResult:
    outputs: list[list[int]]          # new token ids per prompt ([] if rejected)
    finish_reasons: list[str]         # "length", "stop" (EOS / stop id), "max_position", or "rejected"
    rejected: dict[int, str]          # prompt index -> why it could not be served
    stats: RunStats


class Engine:
    def __init__(self, model_or_path, *, kv_format: str = "fp8_ds", indexer_format: str = "mxfp4",
                 tokens_per_block: int = 256, num_blocks: int | None = None, memory_bytes: int | None = None,
                 max_requests: int = 8, device: torch.device | str | None = None, max_batch_tokens: int = 2048,
                 dtype: torch.dtype | None = None, backend: str = "auto", cuda_graphs: bool = True,
                 fp8_weights: bool = False):
        self.tokenizer = None
        self.cuda_graphs = cuda_graphs
        if isinstance(model_or_path, (str, os.PathLike)):
            model, self.tokenizer = load_checkpoint(os.fspath(model_or_path), dtype)
            self.name = os.path.basename(os.path.normpath(os.fspath(model_or_path)))
        else:
            model = model_or_path
            if getattr(getattr(model, "config", None), "model_type", None) != "deepseek_v4":
                raise CheckpointError("Engine needs a transformers DeepseekV4ForCausalLM or its checkpoint "
                                      f"directory, not {type(model).__name__}")
            self.name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        if max_batch_tokens < 1 or max_requests < 1:
            raise ConfigError("max_batch_tokens and max_requests must be at least 1")
        if num_blocks is not None and memory_bytes is not None:
            raise ConfigError("give at most one of num_blocks= or memory_bytes= (neither: sized per call)")
        self.cfg = DSV4Config.from_hf(model.config)
        check_patchable(model, self.cfg)
        # Bad formats or block sizes fail here, not in the middle of a call.
        schemas = build_schemas(self.cfg, tokens_per_block=tokens_per_block, kv_format=kv_format,
                                indexer_format_name=indexer_format)
        self._tokens_per_block, self._fill_ratio = tokens_per_block, block_fill_ratio(schemas)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" != "cuda:0" in device checks
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype if dtype is not None else model.model.embed_tokens.weight.dtype
        self.max_batch_tokens, self.max_requests = max_batch_tokens, max_requests
        self._cache_kw = {"kv_format": kv_format, "indexer_format": indexer_format,
                          "tokens_per_block": tokens_per_block, "device": self.device,
                          "max_batch_tokens": max_batch_tokens, "backend": backend}
        self.manager: KVCacheManager | None = None
        if num_blocks is not None or memory_bytes is not None:  # before the model is touched: may refuse
            self.manager = KVCacheManager(self.cfg, max_requests=max_requests, num_blocks=num_blocks,
                                          memory_bytes=memory_bytes, **self._cache_kw)
        # ---- everything checked: cast, move and patch the model
        if model.model.embed_tokens.weight.dtype != self.dtype:
            cast_like_transformers(model, self.dtype)
        self.model = model.to(self.device).eval()
        match_pinned_norms(self.model)
        self.blocks = patch_attention(self.model, self.cfg, self.dtype)
        if fp8_weights:
            for block in self.blocks:
                block.quantize_weights()
        self.weights = weights_label(self.blocks)
        self.vocab_size = int(model.config.vocab_size)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = model.config.eos_token_id if eos is None else eos
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (int(eos),))

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: list[list[int]], max_new_tokens: int | Sequence[int] = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop_token_ids: Sequence[int] | None = None) -> list[list[int]]:
        """New token ids per prompt (greedy when temperature is 0; [] for a rejected prompt).

        Args:
            prompts: token ids per request; all are submitted at once and served concurrently.
            max_new_tokens: one limit for all, or one per prompt.
            temperature, top_p: sampling (temperature 0 = greedy); seed: per-request generators
                seeded from (seed, prompt index), so a request's tokens do not depend on its neighbours.
            stop_token_ids: end a request when it samples one (kept in the output, as transformers
                does); default the model's EOS ids. A request also ends at max_position_embeddings.
        """
        return self.run(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        seed=seed, stop_token_ids=stop_token_ids).outputs

    def run(self, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int] = 64, temperature: float = 0.0,
            top_p: float = 1.0, seed: int = 0, stop_token_ids: Sequence[int] | None = None,
            progress: bool = False) -> GenerationResult:
        """generate() with statistics and finish reasons; `progress` draws a tqdm bar on stderr."""
        limits = self._check_prompts(prompts, max_new_tokens)
        check_sampling(temperature, top_p)
        stop = set(self.eos_token_ids if stop_token_ids is None else stop_token_ids)
        reqs = [Request(index=i, prompt=list(map(int, p)), max_new_tokens=limits[i],
                        max_len=self.cfg.max_position_embeddings,
                        generator=request_generator(seed, i) if temperature > 0 else None)
                for i, p in enumerate(prompts)]
        mgr = self.manager or self._sized_manager(reqs)
        sched = Scheduler(mgr, self.max_batch_tokens)
        served = [r for r in reqs if sched.submit(r)]
        if not served:
            need = min(sched.lifetime_blocks(r) for r in reqs)
            raise OutOfBlocksError(need, mgr.allocator.num_usable,
                                   "the smallest request (no request fits in the cache at all)")
        rec = StatsRecorder()
        runner = ModelRunner(self.model, self.cfg, mgr, cuda_graphs=self.cuda_graphs)
        total = sum(len(r.prompt) + r.max_new_tokens for r in served)
        t0 = time.perf_counter()
        with _progress(total, progress) as bar:
            try:
                while sched.has_work:
                    self._step(sched, runner, rec, t0, temperature, top_p, stop, bar)
            finally:
                for r in list(sched.running):  # an interrupted call leaves the cache empty
                    sched.finish(r, "aborted")
        wall = time.perf_counter() - t0
        rec.ttfts.extend(r.first_token_s for r in served if r.first_token_s is not None)
        stats = RunStats.build(
            rec, wall_s=wall, requests=len(reqs), completed=len(served), rejected=len(reqs) - len(served),
            prompt_tokens=sum(len(r.prompt) for r in served), generated_tokens=sum(len(r.output) for r in served),
            model=self.name, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            kv_format=mgr.kv_format, indexer_format=mgr.indexer_format, weights=self.weights,
            cuda_graphs=f"{runner.graph_status}, {runner.replays} replayed steps")
        return GenerationResult(
            outputs=[list(r.output) for r in reqs],
            finish_reasons=[r.finish_reason if r.status is Status.FINISHED else "rejected" for r in reqs],
            rejected={r.index: r.reject_reason for r in reqs if r.status is Status.REJECTED}, stats=stats)

    # ------------------------------------------------------------------ one step
    def _step(self, sched: Scheduler, runner: ModelRunner, rec: StatsRecorder, t0: float, temperature: float,
              top_p: float, stop: set[int], bar) -> None:
        ts = time.perf_counter()
        plan = sched.schedule()
        batch = sched.mgr.prepare_forward({r.rid: n for r, n in plan})
        ids: list[int] = []
        rows, sampled = [], []
        prefill = 0
        for r, n in plan:
            ids.extend(r.tokens(n))
            prefill += n if r.in_prefill else 0
            if r.computed + n == r.seq_len:  # its last known token is in this step: sample the next one
                rows.append(len(ids) - 1)
                sampled.append(r)
        dev = self.device
        logits = runner.forward(torch.tensor(ids, dtype=torch.long, device=dev), batch,
                                torch.tensor(rows, dtype=torch.long, device=dev))
        toks = sample(logits, temperature, top_p, [r.generator for r in sampled])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # (sample's .tolist() already waited; keep the timing rule explicit)
        now = time.perf_counter()
        memory = sched.mgr.memory_report()
        held = sum(sched.mgr.seq_len(r.rid) for r in sched.running)
        rec.add_step(prefill, len(ids) - prefill, now - ts, memory, held_tokens=held)
        progress = prefill
        for r, n in plan:
            r.computed += n
        for r, tok in zip(sampled, toks):
            r.output.append(tok)
            progress += 1
            if r.first_token_s is None:
                r.first_token_s = now - t0
            reason = ("stop" if tok in stop else "length" if len(r.output) >= r.max_new_tokens
                      else "max_position" if r.seq_len > r.max_len else "")
            if reason:
                progress += r.max_new_tokens - len(r.output)
                sched.finish(r, reason)
        bar.update(progress)
        bar.set_postfix(running=len(sched.running), waiting=len(sched.waiting), refresh=False)

    # ------------------------------------------------------------------ helpers
    def _check_prompts(self, prompts: list[list[int]], max_new_tokens: int | Sequence[int]) -> list[int]:
        """Validate the call's inputs; returns max_new_tokens per prompt."""
        if not prompts:
            raise InputError("no prompts: give at least one list of token ids")
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != len(prompts) or not all(isinstance(n, int) and n >= 1 for n in limits):
            raise InputError(f"max_new_tokens={max_new_tokens!r}: give a positive integer, or one per prompt")
        limit = self.cfg.max_position_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise InputError(f"prompt {i} is empty: give at least one token id")
            if len(p) > limit:
                raise InputError(f"prompt {i} has {len(p):,} tokens but the model takes at most {limit:,} "
                                 "(max_position_embeddings): shorten it")
            bad = next((t for t in p if not 0 <= int(t) < self.vocab_size), None)
            if bad is not None:
                raise InputError(f"prompt {i} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        return limits

    def _sized_manager(self, reqs: list[Request]) -> KVCacheManager:
        """A cache that holds the `max_requests` largest requests at once (the null block besides)."""
        slots = min(self.max_requests, len(reqs))
        needs = sorted((blocks_needed(min(len(r.prompt) + r.max_new_tokens - 1, r.max_len), self._tokens_per_block,
                                      self._fill_ratio) for r in reqs), reverse=True)
        return KVCacheManager(self.cfg, max_requests=slots, num_blocks=max(2, 1 + sum(needs[:slots])),
                              **self._cache_kw)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", desc="dsv4 run", disable=not enabled, file=sys.stderr, leave=False,
                dynamic_ncols=True)
