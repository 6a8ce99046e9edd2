"""LLM: offline batched generation on top of LLMEngine (prompts in, outputs in prompt order)."""

from __future__ import annotations

import dataclasses

from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.outputs import RequestOutput
from kiln.engine.sampling_params import SamplingParams


class LLM:
    """`LLM(model=None)`: None = the embedded SmolLM2-135M-Instruct GGUF; else a GGUF file or HF dir.
    Extra keyword arguments go to EngineConfig (max_num_seqs, kv_cache_bytes, device, ...)."""

    def __init__(self, model: str | None = None, loaded=None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs), loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids) at once, continuously batched.
        params: one SamplingParams for all, or one per prompt. Returns finished outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"LLM.generate: {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                if isinstance(prompt, str) and not add_special_tokens:
                    prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
                # only the finished output is returned: the engine need not build the others
                p = dataclasses.replace(p, output_kind="final_only")
                engine.add_request(request_id, prompt if isinstance(prompt, str) else list(prompt), p)
                ids.append(request_id)
            wanted = set(ids)  # the engine may also report requests of an earlier call (their aborts)
            while len(finished) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
        except BaseException:  # a bad prompt or a failed step: none of this call's requests run on
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def chat(
        self,
        messages_list: list[list[dict]] | list[dict],
        params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations ([{"role": ..., "content": ...}, ...]) via the chat template.
        `tools`: function definitions ([{"type": "function", "function": {...}}]) the template describes
        to the model (the server's tool_choice reads calls out of the replies; this returns the text);
        `chat_template_kwargs`: more template variables (Qwen3's {"enable_thinking": False})."""
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]
        # Message content is tokenized as text: typed special-token text cannot forge a turn.
        # only what is given (tokenizers of test models take neither)
        extra = {k: v for k, v in (("tools", tools), ("template_kwargs", chat_template_kwargs)) if v}
        prompts = [self.tokenizer.encode_chat(conversation, **extra) for conversation in messages_list]
        return self.generate(prompts, params)
