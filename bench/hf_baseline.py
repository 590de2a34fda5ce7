"""Mode 4: HF transformers in-process on the same GGUF, one request after another.

`generate` alone, then assisted generation on the same prompts: prompt lookup
(`prompt_lookup_num_tokens`) for the n-gram drafter, `assistant_model=` for the model drafter.
Greedy only, as the issue asks. A streamer stamps each token's arrival, so TTFT and the
inter-token gaps mean the same as for the services.
"""
from __future__ import annotations

import os
import time

from bench.load import RequestRecord, RunResult
from bench.prompt_set import Prompt


class _TokenClock:
    """A transformers streamer that records when each batch of new tokens comes out."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt ids
            self._prompt_seen = True
            return
        now = time.perf_counter() - self.start
        self.times.extend([now] * value.numel())

    def end(self) -> None:
        pass


class HFBaseline:
    def __init__(self, model_name: str, draft_model_name: str, threads: int):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tandem.registry import resolve_model_path

        torch.set_num_threads(threads)
        path = resolve_model_path(model_name)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self._assistant = None
        self._draft_path = resolve_model_path(draft_model_name)

    def assistant(self):
        """The draft model for assisted generation: the distilled drafter's layers as an HF Llama.

        HF's assistant needs a full-vocabulary head, so it gets the target's tied embedding
        rather than the draft-vocabulary rows: a little more accurate and a little slower than ours.
        A checkpoint (not a drafter file) loads as it is.
        """
        if self._assistant is None:
            from tandem.loaders.drafter_file import is_drafter_file
            if is_drafter_file(self._draft_path):
                self._assistant = self._assistant_from_drafter_file()
            else:
                from transformers import AutoModelForCausalLM
                self._assistant = AutoModelForCausalLM.from_pretrained(
                    self._draft_path.parent, gguf_file=self._draft_path.name, dtype=self.torch.float32).eval()
        return self._assistant

    def _assistant_from_drafter_file(self):
        import copy

        from transformers import LlamaForCausalLM

        from tandem.loaders.drafter_file import read_drafter_file

        drafter = read_drafter_file(self._draft_path)
        config = copy.deepcopy(self.model.config)
        config.num_hidden_layers = len(drafter.layers)
        assistant = LlamaForCausalLM(config).eval()
        state = {"model.embed_tokens.weight": self.model.model.embed_tokens.weight.detach(),
                 "lm_head.weight": self.model.lm_head.weight.detach(), "model.norm.weight": drafter.norm}
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        for i, layer in enumerate(drafter.layers):
            q, k, v = layer.qkv.split([q_size, kv_size, kv_size])
            gate, up = layer.gate_up.chunk(2)
            prefix = f"model.layers.{i}."
            state.update({prefix + "input_layernorm.weight": layer.attn_norm,
                          prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                          prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": layer.o,
                          prefix + "post_attention_layernorm.weight": layer.mlp_norm,
                          prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                          prefix + "mlp.down_proj.weight": layer.down})
        assistant.load_state_dict(state, strict=True)
        return assistant

    def run(self, prompts: list[Prompt], max_tokens: int, drafter: str | None, k: int) -> RunResult:
        """drafter None: generate alone; "ngram": prompt lookup; "model": assistant_model."""
        extra: dict = {}
        if drafter == "ngram":
            extra["prompt_lookup_num_tokens"] = k
        elif drafter == "model":
            extra["assistant_model"] = self.assistant()
        records = []
        start = time.perf_counter()
        for prompt in prompts:
            ids = self.tokenizer.apply_chat_template(prompt.as_dicts(), add_generation_prompt=True,
                                                     return_tensors="pt", return_dict=True)
            clock = _TokenClock()
            sent = clock.start - start
            with self.torch.inference_mode():
                out = self.model.generate(**ids, max_new_tokens=max_tokens, do_sample=False,
                                          streamer=clock, pad_token_id=self.tokenizer.eos_token_id, **extra)
            e2e = time.perf_counter() - clock.start
            new = out.shape[1] - ids["input_ids"].shape[1]
            times = clock.times[:new]
            finish = "length" if new >= max_tokens else "stop"
            records.append(RequestRecord(
                prompt_id=prompt.id, kind=prompt.kind, sent=sent, ttft=times[0] if times else e2e, e2e=e2e,
                prompt_tokens=ids["input_ids"].shape[1], completion_tokens=new, draft_tokens=0,
                accepted_tokens=0, draft_steps=0, finish_reason=finish,
                itl=[b - a for a, b in zip(times, times[1:])]))
        return RunResult(records, time.perf_counter() - start)
