"""The served model: one frozen base, the revisions resident over it as PEFT adapters, and where they may come from.

A revision loads from the catalog (id, id prefix, name, RUN@STEP) or from a directory under the `--adapter-root` given
at start (symlinks resolved first, so nothing outside the root is read): a peft or per-expert one, as `mint export`
or a rollout actor writes it. A per-expert directory is fused back into the trained layout first, as vLLM loads that
layout (`mint.hub.read_adapter_dir`). Either way its tensors must hash to its id and its base fingerprint must
match the served base; adapters are safetensors, requests are JSON, nothing is unpickled.

Adapter changes and decoding never overlap: the decode worker holds `lock` for a whole batch, and a change first
raises `writers` so the worker admits nothing new, lets the batch drain, and waits before starting the next one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from mint.errors import ConfigError, MintError
from mint.hub import Catalog
from mint.serve._api import HttpError

BASE_ALIASES = ("base",)
log = logging.getLogger("mint.serve")


def _is_path(ref: str) -> bool:
    return "/" in ref or ref.startswith((".", "~"))


class AdapterHost:
    """The base, its tokenizer, and the resident revisions (lora_name -> revision id). No HTTP, no batching."""

    def __init__(
        self,
        base: str,
        catalog: Catalog,
        *,
        dtype: str = "float32",
        device: str | None = None,
        served_name: str | None = None,
        max_resident: int = 8,
        adapter_root: str | None = None,
    ):
        from transformers import AutoTokenizer, DynamicCache

        from mint.hub import base_fingerprint
        from mint.models.specs import load_model, moe_layout
        from mint.models.tiny import resolve_model_path

        self.base_path = resolve_model_path(base)
        self.catalog = catalog
        self.served_name = served_name or base
        self.max_resident = max_resident
        self.adapter_root = None
        if adapter_root is not None:
            if not os.path.isdir(adapter_root):
                raise MintError(f"--adapter-root {adapter_root}: not a directory")
            self.adapter_root = os.path.realpath(adapter_root)
        self.fingerprint = base_fingerprint(self.base_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(self.base_path, dtype).to(device)
        self.layout = moe_layout(self.model.config)
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)
        self.vocab = len(self.tokenizer)
        eos = self.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(set(eos_ids)))
        # Sliding-window layers keep only the window, so left-padded caches of different lengths would misalign.
        self.batchable = not any(
            getattr(layer, "is_sliding", False) for layer in DynamicCache(config=self.model.config).layers
        )
        self.peft = None  # the PeftModel once a revision is resident
        self.resident: dict[str, str] = {}  # lora_name -> revision id
        self.sources: dict[str, str] = {}  # lora_name -> what it was loaded from
        self.loaded_at: dict[str, float] = {}
        self.lock = threading.Lock()  # held by the decode worker for a whole batch, and by adapter changes
        self._writers = 0
        self._writers_cv = threading.Condition()

    # ---- who runs -----------------------------------------------------------------------------------------------

    @property
    def writers_waiting(self) -> bool:
        return self._writers > 0

    def wait_for_writers(self) -> None:
        with self._writers_cv:
            self._writers_cv.wait_for(lambda: self._writers == 0)

    @contextmanager
    def _writing(self):
        with self._writers_cv:
            self._writers += 1
        try:
            with self.lock:
                yield
        finally:
            with self._writers_cv:
                self._writers -= 1
                self._writers_cv.notify_all()

    def resolve_model(self, model: str) -> str | None:
        """The revision id a request's `model` names (its lora_name or revision id), or None for the base."""
        if model in BASE_ALIASES or model == self.served_name:
            return None
        if model in self.resident:
            return self.resident[model]
        if model in self.resident.values():
            return model
        raise HttpError(404, f"model {model!r} is not served; load it with /v1/load_lora_adapter", "model")

    @contextmanager
    def activate(self, rid: str | None):
        """Under `lock`: the model to decode `rid` with (the base with every adapter off for None)."""
        if rid is None:
            with self.peft.disable_adapter() if self.peft is not None else nullcontext():
                yield self.peft or self.model
            return
        if rid not in self.resident.values():
            raise HttpError(404, f"revision {rid[:12]} was unloaded before the request ran", "model")
        self.peft.set_adapter(self._adapter(rid))
        yield self.peft

    # ---- adapters -----------------------------------------------------------------------------------------------

    @staticmethod
    def _adapter(rid: str) -> str:
        return f"rev_{rid}"

    def _read_catalog(self, ref: str):
        from mint.hub import check_base

        try:
            rid = self.catalog.resolve(ref)
        except MintError as err:
            raise HttpError(404, str(err), "lora_path") from None
        try:
            tensors, meta = self.catalog.load(rid)  # hash verified
            check_base(meta, self.base_path)
        except MintError as err:
            raise HttpError(400, str(err), "lora_path") from None
        return tensors, meta.id, meta.lora_config

    def _read_dir(self, ref: str):
        """A peft or per-expert directory under the adapter root, in the trained layout (a per-expert one fused back)
        and hash-checked against its recorded id; a merged export is refused."""
        from mint.hub import META_FILE, RevisionMeta, check_base, read_adapter_dir

        if self.adapter_root is None:
            raise HttpError(
                400,
                f"{ref!r}: mint serve loads revisions only from its catalog (id, name or RUN@STEP); directories need "
                "--adapter-root at start",
                "lora_path",
            )
        path = os.path.realpath(os.path.join(self.adapter_root, os.path.expanduser(ref)))
        if os.path.commonpath([path, self.adapter_root]) != self.adapter_root:
            raise HttpError(403, f"{ref!r} is outside --adapter-root {self.adapter_root}; refusing", "lora_path")
        if not os.path.isdir(path):
            raise HttpError(404, f"{ref!r}: no such adapter directory under --adapter-root", "lora_path")
        try:
            tensors, lora_config, meta = read_adapter_dir(Path(path), self.model.config)  # hash == recorded id
            check_base(
                RevisionMeta.from_dict({"run": "", "step": 0, "parent": None, "created": 0, **meta}), self.base_path
            )
        except MintError as err:
            raise HttpError(400, str(err), "lora_path") from None
        except (TypeError, KeyError) as err:
            raise HttpError(400, f"{ref}: unreadable {META_FILE} ({err})", "lora_path") from None
        return tensors, meta["id"], lora_config

    def load(self, lora_name: str, ref: str, inplace: bool = False) -> dict:
        """vLLM's load_lora_adapter: `ref` is a catalog ref or an exported directory under the adapter root.
        An existing name is refused unless `inplace`, which points it at the new revision."""
        from peft import PeftModel, set_peft_model_state_dict

        from mint.hub import peft_lora_config
        from mint.models.expert_lora import factor_experts

        if not lora_name or lora_name in (*BASE_ALIASES, self.served_name):
            raise HttpError(400, f"lora_name: {lora_name!r} is empty or names the base", "lora_name")
        tensors, rid, lora_config = self._read_dir(ref) if _is_path(ref) else self._read_catalog(ref)
        with self._writing():
            old = self.resident.get(lora_name)
            if old == rid:
                return {"lora_name": lora_name, "revision": rid, "status": "already loaded"}
            if old is not None and not inplace:
                raise HttpError(
                    400, f"lora_name {lora_name!r} is loaded with another revision; unload it or pass load_inplace"
                )
            adapter = self._adapter(rid)
            if rid not in self.resident.values():
                resident = set(self.resident.values()) - ({old} if old is not None else set())
                if len(resident) >= self.max_resident:
                    raise HttpError(400, f"{self.max_resident} revisions are resident; unload one first")
                config = peft_lora_config(lora_config)
                # As the rollout actors build it (`mint.models.lora.add_lora`): LoRA in the base's dtype, and fused
                # experts computing their LoRA factored, so served logprobs are the actors' to the last bit.
                if self.peft is None:
                    self.peft = PeftModel(self.model, config, adapter_name=adapter, autocast_adapter_dtype=False)
                else:
                    self.peft.add_adapter(adapter, config, autocast_adapter_dtype=False)
                result = set_peft_model_state_dict(self.peft, tensors, adapter_name=adapter)
                if getattr(result, "unexpected_keys", None):
                    self._drop(adapter)
                    raise HttpError(400, f"revision {rid[:12]} has keys this base lacks: {result.unexpected_keys[:2]}")
                self.peft.eval()
                try:
                    factor_experts(self.peft)
                except ConfigError as err:  # a layout the factored path does not mirror: PEFT's own forward runs
                    log.warning("revision %s: experts LoRA not factored (%s)", rid[:12], err)
            self.resident[lora_name], self.sources[lora_name] = rid, ref
            self.loaded_at[lora_name] = time.time()
            if old is not None and old not in self.resident.values():
                self._drop(self._adapter(old))
        return {"lora_name": lora_name, "revision": rid, "status": "replaced" if old else "loaded"}

    def _drop(self, adapter: str) -> None:
        remaining = [a for a in self.peft.peft_config if a != adapter]
        if not remaining:  # PEFT cannot run with zero adapters: take the LoRA layers out again
            self.model = self.peft.unload()
            self.peft = None
            return
        self.peft.set_adapter(remaining[0])
        self.peft.delete_adapter(adapter)

    def unload(self, lora_name: str) -> dict:
        with self._writing():
            if lora_name not in self.resident:
                raise HttpError(404, f"lora_name {lora_name!r} is not loaded", "lora_name")
            rid = self.resident.pop(lora_name)
            self.sources.pop(lora_name, None)
            self.loaded_at.pop(lora_name, None)
            if rid not in self.resident.values():
                self._drop(self._adapter(rid))
        return {"lora_name": lora_name, "revision": rid, "status": "unloaded"}

    def models(self) -> list[dict]:
        """The base and every resident revision, as OpenAI model objects (vLLM lists LoRA modules the same way)."""
        now = int(time.time())
        data = [dict(id=self.served_name, created=now, root=self.base_path, parent=None)]
        for name, rid in sorted(dict(self.resident).items()):
            data.append(dict(id=name, created=int(self.loaded_at.get(name, now)), root=rid, parent=self.served_name))
        return data
