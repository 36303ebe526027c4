"""The user-facing facade, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from models.llama import LlamaConfig
from models.loading import load_blocks, load_model, load_tokenizer, read_generation_eos
from specjax.backends import step_cost_slots
from specjax.buckets import enable_persistent_cache
from specjax.builtin import DEFAULT_SPEC, DEFAULT_TARGET, resolve_model
from specjax.config import EngineConfig, SamplingParams, SpeculativeConfig
from specjax.engine import Engine
from specjax.runner import StepRunner
from specjax.outputs import RequestOutput, StopStrings, banned_token_ids, completion, prompt_logprobs
from specjax.outputs import CompletionOutput  # noqa: F401  (re-exported)
from specjax.parallel.sharding import ShardingPlan, check_int8_activations, make_mesh, resolve_draft_quantization
from specjax.prompts import as_prompt_list, parse_prompt
from specjax.scheduler import Request
from specjax.spec_decode.proposer import BuildContext, Proposer
from specjax.spec_decode.proposer import build as build_proposer
from specjax.step import MAX_BIAS, MAX_STOP_IDS

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _request_metrics(r: Request) -> dict[str, Any]:
    return {
        "num_draft_tokens": r.num_draft_tokens,
        "num_accepted_tokens": r.num_accepted_tokens,
        "acceptance_rate": r.num_accepted_tokens / r.num_draft_tokens if r.num_draft_tokens else None,
        "num_spec_steps": r.num_spec_steps,
        "num_preemptions": r.num_preemptions,
        "time_to_first_token_s": r.first_token_time - r.arrival_time if r.first_token_time is not None else None,
        "latency_s": r.last_token_time - r.arrival_time,
    }


class LLM:
    """Load a Hugging Face-format Llama-family checkpoint and generate from it.

    Args mirror vLLM's ``LLM``. ``warmup=True`` compiles every static-shape
    bucket up front (the JAX counterpart of CUDA-graph capture), so generation
    then compiles nothing; ``warmup=False`` compiles each bucket on first use.
    Compiled executables go to JAX's persistent compilation cache
    (``compilation_cache``: None = on in ``~/.cache/specjax/xla`` unless
    ``SPECJAX_COMPILATION_CACHE=0``; False = off; a path), so a second run of
    the same configuration loads them instead of compiling. ``profile=True``
    runs each step as four separately timed executables and reports
    ``draft_time_s`` / ``verify_time_s`` / ``sample_time_s`` (slower; the
    default path has no sync besides the step's one fetch).

    ``int8_activations=True`` (a GGUF model file on one CPU device): the
    file's Q4_0 / Q4_1 / Q8_0 blocks multiply activations quantized to int8
    per block of 32, as llama.cpp does, with integer dot products (VNNI where
    the CPU has it); faster steps, logits close to but not equal to the float
    product's. Speculation stays exact for this model: a verify row is computed
    as the plain step's row. Refused (ValueError) where it cannot apply.

    ``mixed_step_padding`` (:class:`~specjax.config.EngineConfig`): what one step's own cost is worth in
    padded token slots. Decoding rows and prompt chunks run as separate steps, taking turns, where one step of
    both would pad more slots than this beyond the two steps (each decoding row of a mixed step is padded to the
    chunks' query length), and always while the decoding rows draft (a step with a prompt chunk verifies no
    drafts); prompt chunks are cut to a shorter query bucket where that costs less per prompt token. None always
    mixes them and never cuts. ``"auto"``: 16 on CPU (measured), 256 on GPU and TPU (not
    measured: see :data:`specjax.backends.STEP_COST_SLOTS`).

    ``tensor_parallel_size`` splits target and draft over a ``tp`` mesh axis and
    ``data_parallel_size`` splits each step's rows over a ``dp`` axis (see
    :mod:`specjax.parallel.sharding`); ``tp * dp`` local devices are used.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        tokenizer: str | os.PathLike | None = None,
        dtype: str = "float32",
        max_model_len: int = 512,
        max_num_seqs: int = 8,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        speculative_config: dict | None = None,
        seed: int = 0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_prefill_chunk: int = 128,
        batch_buckets: Sequence[int] | None = None,
        query_buckets: Sequence[int] | None = None,
        mixed_step_padding: int | str | None = "auto",
        warmup: bool = True,
        profile: bool = False,
        compilation_cache: bool | str | os.PathLike | None = None,
        int8_activations: bool = False,
    ):
        if model is None:
            # The default pair: SmolLM2-135M-Instruct verified against the EAGLE-3 head trained for it.
            model = DEFAULT_TARGET
            if speculative_config is None:
                speculative_config = dict(DEFAULT_SPEC)
        model = resolve_model(model)
        enable_persistent_cache(compilation_cache)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        spec = SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None
        # Before loading weights: a bad parallel layout fails fast, naming the field.
        self.mesh = make_mesh(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size)
        self.model_path = os.fspath(model)
        if not isinstance(int8_activations, bool):
            raise ValueError(f"int8_activations must be True or False, got {int8_activations!r}")
        quantized = load_blocks(self.model_path)
        if int8_activations:  # before loading weights, as above
            check_int8_activations(self.mesh, quantized)
        if spec is not None:
            spec = resolve_draft_quantization(self.mesh, spec)
        self.model_config, params = load_model(self.model_path, dtype=dtype)
        max_pos = self.model_config.max_position_embeddings
        if max_pos and max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}")
        window = self.model_config.sliding_window
        if window is not None and max_model_len > window:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's sliding_window={window}; "
                "sliding-window attention is not implemented, so keep max_model_len <= sliding_window"
            )
        self.engine_config = EngineConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_chunk=max_prefill_chunk,
            batch_buckets=tuple(batch_buckets) if batch_buckets is not None else None,
            query_buckets=tuple(query_buckets) if query_buckets is not None else None,
            seed=seed,
            data_parallel_size=data_parallel_size,
            mixed_step_padding=step_cost_slots() if mixed_step_padding == "auto" else mixed_step_padding,
        )
        self.tokenizer_path = os.fspath(tokenizer) if tokenizer is not None else self.model_path
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.eos_token_ids = tuple(read_generation_eos(self.model_path, self.model_config))
        draft_tp = spec.draft_tensor_parallel_size if spec is not None else None
        if draft_tp not in (None, 1, tensor_parallel_size):
            raise ValueError(f"draft_tensor_parallel_size must be 1 or the target's tensor_parallel_size="
                             f"{tensor_parallel_size}, got {draft_tp}")
        if spec is not None and spec.max_model_len is not None and spec.max_model_len < max_model_len:
            raise ValueError(
                f"speculative_config.max_model_len={spec.max_model_len} is below LLM max_model_len="
                f"{max_model_len}; drafting stops at max_model_len, lower the LLM's instead"
            )
        self.speculative_config = spec
        proposer = Proposer()
        if spec is not None:
            proposer = build_proposer(BuildContext(
                spec=spec, target_config=self.model_config, engine_config=self.engine_config,
                tokenizer=self.tokenizer, dtype=dtype, tensor_parallel_size=tensor_parallel_size, mesh=self.mesh,
                target=model,
            ))
        self.runner = StepRunner(
            self.model_config, params, proposer, self.engine_config, spec=spec, kv_dtype=_DTYPES[dtype],
            plan=ShardingPlan(mesh=self.mesh, tp=tensor_parallel_size), profile=profile,
            quantized=quantized, int8_activations=int8_activations,
        )
        self.engine = Engine(self.runner, self.engine_config, spec=spec)
        self._request_counter = itertools.count()
        self._generate_seconds = 0.0
        if warmup:
            start = time.perf_counter()
            self.warmup()
            logger.info("warmup compiled %d executables in %.1fs", self.num_compiles, time.perf_counter() - start)

    @property
    def config(self) -> LlamaConfig:
        return self.model_config

    # ------------------------------------------------------------------ requests

    def validate_prompt(self, prompt, *, field: str = "prompt", name_keys: bool = True) -> list[int]:
        """The token ids of one prompt, checked against this model; ``ValueError`` naming ``field`` otherwise.

        ``prompt`` is a str, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, as :meth:`generate`
        takes it. With ``name_keys`` the messages name the dict key too (``field.prompt_token_ids``);
        without, ``field`` alone names the offending value (for callers with their own field names).
        """
        return self._prompt_ids(prompt, field, name_keys=name_keys)[1]

    def _prompt_ids(self, prompt, field: str, *, name_keys: bool = True) -> tuple[str | None, list[int]]:
        return parse_prompt(prompt, field, tokenizer=self.tokenizer, vocab_size=self.model_config.vocab_size,
                            max_model_len=self.engine_config.max_model_len, name_keys=name_keys)

    def _make_request(self, ids: list[int], params: SamplingParams, index: int = 0) -> Request:
        """One request; ``index`` is the completion's number among ``params.n``."""
        n = next(self._request_counter)
        if params.seed is not None:
            seed, stream = params.seed, 2 * index  # completion 0 of a seeded request: what n = 1 gives
        else:
            # Derived seeds differ per request and per LLM seed; odd streams keep them apart from user seeds.
            seed = (self.engine_config.seed * 0x9E3779B1 + n) % 2**32
            stream = 2 * index + 1
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        if params.min_tokens and len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"min_tokens: the request has {len(stop_ids)} stop ids (EOS + stop_token_ids); "
                             f"min_tokens can hold back at most {MAX_STOP_IDS}")
        bias = dict(params.logit_bias or ())
        if params.bad_words:
            bias.update({t: float("-inf") for t in banned_token_ids(self.tokenizer, params.bad_words,
                                                                   self.model_config.vocab_size)})
        bad = [t for t in bias if t >= self.model_config.vocab_size]
        if bad:
            raise ValueError(f"logit_bias has ids outside [0, {self.model_config.vocab_size}): {bad[:5]}")
        if len(bias) > MAX_BIAS:
            raise ValueError(f"logit_bias and bad_words ban or bias {len(bias)} tokens; at most {MAX_BIAS}")
        stop_checker = None
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need the model's tokenizer")
            stop_checker = StopStrings(self.tokenizer, params.stop, params.skip_special_tokens)
        return Request(
            request_id=str(n), prompt_token_ids=ids, params=params, seed=seed, seed_stream=stream,
            stop_ids=frozenset(stop_ids), logit_bias=(tuple(bias), tuple(bias.values())), stop_checker=stop_checker,
            output_logprobs=[] if params.logprobs is not None else None,
        )

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts`` (str, {'prompt_token_ids': [...]}, {'prompt': str} or a list).

        Every prompt is validated before any runs: a bad one raises ValueError
        naming it, and the engine is left as it was.
        """
        prompt_list = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        for i, p in enumerate(params_list):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        parsed = [self._prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(prompt_list)]
        groups = [[self._make_request(ids, params, j) for j in range(params.n)]
                  for (_, ids), params in zip(parsed, params_list)]
        requests = [r for group in groups for r in group]
        for request in requests:
            self.engine.add_request(request)
        start = time.perf_counter()
        bar = None
        if use_tqdm and len(requests) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="generate", unit="req")
        try:
            while self.engine.has_unfinished:
                finished = self.engine.step()
                if bar is not None and finished:
                    bar.update(len(finished))
                    bar.set_postfix(tok_s=f"{self.engine.stats.num_generated_tokens / (time.perf_counter() - start):.1f}")
        except BaseException:
            # Leave no half-run request behind to leak into the next call (or to hold KV blocks).
            self.engine.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        self._generate_seconds += time.perf_counter() - start
        outputs = []
        for (text, ids), params, group in zip(parsed, params_list, groups):
            prompt_lp = None
            if params.prompt_logprobs is not None:
                prompt_lp = prompt_logprobs(self.runner.params[0], self.model_config, ids, params.prompt_logprobs,
                                            self.tokenizer)
            outputs.append(RequestOutput(
                request_id=group[0].request_id, prompt=text, prompt_token_ids=list(ids),
                outputs=[completion(j, r, self.tokenizer) for j, r in enumerate(group)],
                metrics=_request_metrics(group[0]), prompt_logprobs=prompt_lp,
            ))
        return outputs

    def get_tokenizer(self):
        """The model's ``tokenizers.Tokenizer`` (None when the model directory has none)."""
        return self.tokenizer

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of them.

        Each conversation is rendered with the model's chat template (:mod:`specjax.chat`), tokenized and
        generated like a prompt of :meth:`generate`; a bad message raises ValueError naming it.
        """
        prompts = self.chat_prompts(messages, add_generation_prompt=add_generation_prompt)
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out, prompt in zip(outputs, prompts):
            out.prompt = self.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)
        return outputs

    def chat_prompts(self, messages, *, add_generation_prompt: bool = True) -> list[dict]:
        """One conversation (a list of ``{"role", "content"}``) or a list of them, rendered with the model's chat
        template and tokenized: prompts for :meth:`generate` (``{"prompt_token_ids": [...]}``)."""
        from specjax.chat import ChatTemplate

        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer (tokenizer.json or GGUF metadata)")
        single = isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        if not conversations:
            raise ValueError("messages must be a non-empty list of messages (or of conversations)")
        template = ChatTemplate.for_model(self.tokenizer_path)
        prompts = []
        for i, conv in enumerate(conversations):
            text = template.render(conv, add_generation_prompt, field="messages" if single else f"messages[{i}]")
            ids = self.tokenizer.encode(text, add_special_tokens=template.add_special_tokens).ids
            prompts.append({"prompt_token_ids": ids})
        return prompts

    def warmup(self, prompts: Sequence | None = None) -> None:
        """Compile every bucket now (``LLM(warmup=True)`` already did).

        ``prompts`` (as :meth:`generate` takes them): compile only the prefill lengths these prompts need, for a
        caller that knows its whole workload (``specjax generate``); other lengths compile on first use.
        """
        lengths = None if prompts is None else [len(self.validate_prompt(p, field=f"prompts[{i}]"))
                                                for i, p in enumerate(prompts)]
        self.engine.warmup(prompt_lengths=lengths)

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    @property
    def compile_seconds(self) -> float:
        return self.runner.compile_seconds

    def get_metrics(self) -> dict[str, Any]:
        s = self.engine.stats
        return {
            "num_requests": s.num_finished_requests,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            "num_steps": s.num_steps,
            "num_row_steps": s.num_row_steps,
            "num_preemptions": self.engine.scheduler.num_preemptions,
            "num_compiles": self.num_compiles,
            "compile_seconds": self.compile_seconds,
            "generate_seconds": self._generate_seconds,
            "generation_tokens_per_s": s.num_generated_tokens / self._generate_seconds if self._generate_seconds else 0.0,
            "mean_step_s": s.step_seconds / s.num_steps if s.num_steps else 0.0,
            **self.engine.latency.as_dict(),
            **(self.engine.spec_stats.as_dict() if self.engine.spec_stats is not None else {}),
            **({f"{k}_time_s": v for k, v in self.runner.phase_seconds.items()} if self.runner.profile else {}),
            **(self.engine.controller.as_dict() if self.engine.controller is not None else {}),
        }
