"""``KvownConnector``: kvown as a vLLM KV connector (``KVConnectorBase_V1``, both roles, push profile).

Owns: the glue between vLLM's hooks and the two halves that do the work - ``plan.Planner`` in the
scheduler (engine-core) process and ``worker.WorkerSide`` in each worker process - and the step's
metadata that carries the planner's decisions to the workers. Configure it with::

    --kv-transfer-config '{"kv_connector": "KvownConnector",
                           "kv_connector_module_path": "kvown.integrations.vllm",
                           "kv_role": "kv_producer",              # prefill; "kv_consumer" for decode
                           "kv_connector_extra_config": {"etcd": "http://127.0.0.1:2379",
                                                         "cluster": "pd", "rank": 0}}'

and ``KVOWN_JOB_KEY`` (hex, the same on every instance) in the environment. The proxy passes
``kv_transfer_params = {"kvown_request_id": ..., "kvown_writer": <the prefill's kvown rank>,
"do_remote_decode" | "do_remote_prefill": true}`` to both legs at once (``kvown serve vllm``).

Rules:
  1. The prefill side (``kv_producer``) writes; the decode side (``kv_consumer``) publishes vLLM's own
     destination blocks and is the only side that ever decides they may be reused: through
     ``finished_recving``, reported only after kvown retired them with proof (``worker`` rule 1).
  2. vLLM's scheduler holds an aborted request's blocks while it waits for remote KV (delay free) until
     that report: an abort never frees destination blocks early, and a writer that cannot be proven
     quiescent is held until kvown fail-stops the decode worker at its deadline.
  3. Hooks the connector has no work for return at once (vLLM calls them every step).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvown.integrations.vllm.plan import Planner, StepPlan
from kvown.integrations.vllm.worker import WorkerSettings, WorkerSide


class KvownMetadata(KVConnectorMetadata):
    """One step's plan, shipped by vLLM from the scheduler to every worker (picklable)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvownConnector(KVConnectorBase_V1):
    """kvown's connector; built once per role (``SCHEDULER`` in the engine core, ``WORKER`` per worker)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._extra = dict(transfer.kv_connector_extra_config or {})
        self._producer, self._consumer = transfer.is_kv_producer, transfer.is_kv_consumer
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._planner: Planner | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = Planner(block_size=self._block_size, consumer=self._consumer, producer=self._producer)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            settings = WorkerSettings.from_extra(self._extra, tp_rank=get_tensor_model_parallel_rank())
            roles = ({"sender"} if self._producer else set()) | ({"receiver"} if self._consumer else set())
            device = str(getattr(vllm_config.device_config, "device_type", "cpu") or "cpu")
            self._worker = WorkerSide(settings, roles=roles, device="cuda" if device == "cuda" else "cpu")

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        num_blocks = self._num_blocks or next(iter(kv_caches.values())).shape[0]
        self._worker.start(kv_caches, num_blocks)

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvownMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and self._worker is not None and self._worker.rt is not None:
            self._worker.act(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request decodes only after its KV landed and retired

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the send opens once the whole forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None and plan.sends and self._worker is not None:
            self._worker.save(plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None or self._worker.rt is None:
            return KVConnectorTransferResults()
        out = self._worker.report(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=out.sending, finished_recving=out.recving,
                                          failed_recving=out.failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ---- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._planner is not None
        return self._planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._planner is not None
        group = blocks.blocks[0] if blocks.blocks else []
        unhashed = [b.block_id for b in group if b.block_hash is None and not b.is_null]
        hashed = sum(1 for b in group if b.block_hash is not None and not b.is_null)
        self._planner.after_alloc(request, unhashed, hashed, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._planner is not None
        manager = self._kv_cache_manager

        def block_ids_of(req_id: str) -> list[int]:
            return list(manager.get_block_ids(req_id)[0]) if manager is not None else []

        return KvownMetadata(self._planner.build(dict(scheduler_output.num_scheduled_tokens), block_ids_of))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._planner is not None:
            self._planner.reported(connector_output.finished_sending, connector_output.finished_recving)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        return self._planner.finished(request)


__all__ = ["KvownConnector", "KvownMetadata"]
