"""Bad configurations fail in the driver, at construction, naming field, value and choices."""

import pytest

from ray_train_xla import TorchXLAConfig, XLAConfigError

BAD = [
    ({"device": "gpu"}, "TorchXLAConfig.device='gpu' is not valid: expected one of 'auto', "
                        "'neuron', 'tpu', 'cpu'"),
    ({"device": "cuda"}, "TorchXLAConfig.device='cuda'"),
    ({"runtime": "xla"}, "TorchXLAConfig.runtime='xla' is not valid: expected one of 'pjrt', 'xrt'"),
    ({"runtime": "xrt", "device": "tpu"}, "XRT is only supported by legacy torch-neuronx"),
    ({"runtime": "xrt", "device": "cpu"}, "TorchXLAConfig.runtime='xrt'"),
    ({"neuron_parallel_compile": "yes"}, "neuron_parallel_compile='yes' is not valid: expected "
                                         "True or False"),
    ({"neuron_parallel_compile": True, "device": "cpu"}, "parallel compile is a Neuron feature"),
    ({"timeout_s": 0}, "TorchXLAConfig.timeout_s=0 is not valid: expected a number of seconds >= 1"),
    ({"timeout_s": 0.5}, "TorchXLAConfig.timeout_s=0.5 is not valid"),
    ({"timeout_s": -5}, "timeout_s=-5"),
    ({"timeout_s": "60"}, "timeout_s='60'"),
    ({"timeout_s": True}, "timeout_s=True"),
    ({"env": ["A=1"]}, "TorchXLAConfig.env=['A=1'] is not valid: expected a mapping"),
    ({"env": {"A=B": "1"}}, "variable names without '='"),
    ({"env": {"A": None}}, "TorchXLAConfig.env['A']=None is not valid: expected a string"),
    ({"efa": "auto"}, "TorchXLAConfig.efa='auto' is not valid: expected None (detect), True or False"),
    ({"efa": 1}, "TorchXLAConfig.efa=1 is not valid: expected None (detect), True or False"),
    ({"efa": 0}, "TorchXLAConfig.efa=0 is not valid"),
    ({"spmd": 1}, "TorchXLAConfig.spmd=1 is not valid"),
    ({"compile_cache": ""}, "TorchXLAConfig.compile_cache=''"),
    ({"peak_tflops": 0}, "TorchXLAConfig.peak_tflops=0 is not valid: expected None (the "
                         "device's published peak, or on CPU a matmul probe) or a number > 0"),
    ({"peak_tflops": -95.0}, "TorchXLAConfig.peak_tflops=-95.0 is not valid"),
    ({"peak_tflops": True}, "TorchXLAConfig.peak_tflops=True is not valid"),
    ({"peak_tflops": "95"}, "TorchXLAConfig.peak_tflops='95' is not valid"),
    ({"peak_tflops": float("inf")}, "TorchXLAConfig.peak_tflops=inf is not valid"),
    ({"peak_tflops": float("nan")}, "TorchXLAConfig.peak_tflops=nan is not valid"),
    ({"backend": "neuron"}, "TorchXLAConfig.backend='neuron' is not valid: expected no value"),
    ({"init_method": "tcp"}, "TorchXLAConfig.init_method='tcp' is not valid"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_config_is_rejected_with_a_clear_message(kwargs, message):
    with pytest.raises(XLAConfigError) as info:
        TorchXLAConfig(**kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_good_config_is_a_torch_config_with_our_backend():
    from ray.train.torch import TorchConfig

    from ray_train_xla.driver.backend import XLABackend

    config = TorchXLAConfig(device="cpu", timeout_s=30, env={"FOO": "1", "N": 3})
    assert isinstance(config, TorchConfig)
    assert config.backend_cls is XLABackend
    assert config.to_dict()["env"] == {"FOO": "1", "N": 3}


def test_importing_the_package_does_not_import_torch_xla():
    import subprocess
    import sys

    code = "import sys, ray_train_xla; print('torch_xla' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_fields_are_keyword_only():
    # TorchXLAConfig("neuron") used to set the inherited `backend` field and keep device="auto".
    with pytest.raises(TypeError):
        TorchXLAConfig("neuron")


def test_timeout_is_kept_as_given_in_the_plan():
    from ray_train_xla.planning import Rendezvous, plan
    from ray_train_xla.planning.contract import TIMEOUT_VAR
    from ray_train_xla.planning.topology import Topology

    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r")
    for given, planned in ((2.5, "2.5"), (90, "90"), (1, "1")):
        env = plan(Topology.uniform([1]), TorchXLAConfig(device="cpu", timeout_s=given), rdzv, "cpu")[0].env
        assert env[TIMEOUT_VAR] == planned


def test_peak_tflops_is_checked_on_every_config_and_planned_for_every_worker():
    from ray_train_xla import TorchNeuronConfig, TorchTPUConfig
    from ray_train_xla.planning import Rendezvous, plan
    from ray_train_xla.planning.contract import PEAK_TFLOPS_VAR, WorkerContext
    from ray_train_xla.planning.topology import Topology

    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r")
    for cls in (TorchXLAConfig, TorchNeuronConfig, TorchTPUConfig):
        with pytest.raises(XLAConfigError, match=f"{cls.__name__}.peak_tflops=0 is not valid"):
            cls(device="cpu", peak_tflops=0)
        assert PEAK_TFLOPS_VAR not in plan(Topology.uniform([2]), cls(device="cpu"), rdzv,
                                           "cpu")[1].env
        envs = [p.env for p in plan(Topology.uniform([2]), cls(device="cpu", peak_tflops=79),
                                    rdzv, "cpu")]
        assert [e[PEAK_TFLOPS_VAR] for e in envs] == ["79.0", "79.0"]
        assert WorkerContext.from_env(envs[1]).peak_tflops == 79.0
    assert WorkerContext.from_env({}).peak_tflops == 0.0
    with pytest.raises(XLAConfigError, match="RAY_TRAIN_XLA_PEAK_TFLOPS"):
        TorchXLAConfig(env={PEAK_TFLOPS_VAR: "79"})  # only the field sets it


class _RecordingWorkerGroup:
    """Stands in for Ray's worker group to show the backend validates before using it."""

    def __init__(self):
        self.calls = []

    def execute(self, fn, *args):
        self.calls.append(fn.__name__)
        raise AssertionError("the backend reached the workers with an invalid config")

    execute_single = execute


def test_a_field_changed_after_construction_is_rejected_when_the_backend_starts():
    from ray_train_xla.driver.backend import XLABackend

    config = TorchXLAConfig(device="cpu")
    config.efa = "yes"
    group = _RecordingWorkerGroup()
    with pytest.raises(XLAConfigError, match="TorchXLAConfig.efa='yes' is not valid"):
        XLABackend().on_start(group, config)
    assert group.calls == []


@pytest.mark.parametrize("cls,kwargs,words", [
    ("TorchTPUConfig", {"efa": True}, ["TorchTPUConfig.efa=True is not valid",
                                       "efa is an option of TorchXLAConfig and TorchNeuronConfig",
                                       "its options are device, timeout_s, env, compile_cache"]),
    ("TorchNeuronConfig", {"spmd": True}, ["TorchNeuronConfig.spmd=True",
                                           "spmd is an option of TorchXLAConfig, not of "
                                           "TorchNeuronConfig"]),
    ("TorchXLAConfig", {"compile_cahce": "/c"}, ["TorchXLAConfig has no option compile_cahce "
                                                 "(did you mean compile_cache?)"]),
    ("TorchNeuronConfig", {"bogus": 1}, ["TorchNeuronConfig has no option bogus;"]),
])
def test_an_unknown_keyword_names_the_fields_and_the_config_it_belongs_to(cls, kwargs, words):
    """Not the dataclass's bare TypeError: the same XLAConfigError as any other bad option."""
    import ray_train_xla
    from ray_train_xla.planning import options

    for config in (getattr(ray_train_xla, cls), getattr(options, {
            "TorchXLAConfig": "XLAOptions", "TorchNeuronConfig": "NeuronOptions",
            "TorchTPUConfig": "TPUOptions"}[cls])):
        with pytest.raises(XLAConfigError) as info:
            config(device="cpu", **kwargs)
        for word in words:
            assert word in str(info.value), str(info.value)


# compile_cache, one rule: (config, device) -> (accepted, refused).
CACHES = {
    ("TorchXLAConfig", "neuron"): (["/fsx/c", "s3://b/c"], ["gs://b/c", "hdfs://n/c"]),
    ("TorchXLAConfig", "tpu"): (["/fsx/c"], ["s3://b/c", "gs://b/c"]),
    ("TorchXLAConfig", "auto"): (["/fsx/c", "s3://b/c"], ["gs://b/c"]),
    ("TorchNeuronConfig", "neuron"): (["/fsx/c"], ["s3://b/c", "gs://b/c"]),
    ("TorchNeuronConfig", "cpu"): (["/fsx/c"], ["s3://b/c"]),
    ("TorchTPUConfig", "tpu"): (["/fsx/c", "gs://b/c"], ["s3://b/c", "az://c/d"]),
    ("TorchTPUConfig", "auto"): (["gs://b/c"], ["s3://b/c"]),
}


@pytest.mark.parametrize("owner,device", list(CACHES), ids=[f"{o}-{d}" for o, d in CACHES])
def test_compile_cache_takes_what_its_runtime_reads(owner, device):
    import ray_train_xla

    cls = getattr(ray_train_xla, owner)
    accepted, refused = CACHES[(owner, device)]
    for cache in accepted:
        assert cls(device=device, compile_cache=cache).compile_cache == cache
    for cache in [*refused, "", "  "]:
        with pytest.raises(XLAConfigError) as info:
            cls(device=device, compile_cache=cache)
        assert f"{owner}.compile_cache={cache!r} is not valid" in str(info.value)
        assert "a directory path every node shares" in str(info.value)


def test_each_compile_cache_is_planned_as_the_rule_says_and_checked_again_at_start():
    """The variable of COMPILE_CACHES is what the plan sets; TorchXLAConfig(device="auto")
    with an s3:// cache is refused when the backend resolves the device to TPU."""
    import ray_train_xla
    from ray_train_xla.planning import Rendezvous, plan
    from ray_train_xla.planning.options import COMPILE_CACHES
    from ray_train_xla.planning.topology import Topology, WorkerFacts

    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r", extra_ports=(1, 2))
    for (owner, device), cache in COMPILE_CACHES.items():
        resource = {"neuron": "neuron_cores", "tpu": "TPU"}[device]
        facts = [WorkerFacts(node_id="n", node_ip="10.0.0.1", pid=1, accelerator_ids={resource: ("0",)},
                             tpu_topology="1x1" if device == "tpu" else "")]
        config = getattr(ray_train_xla, owner)(device=device, compile_cache="/fsx/c")
        (p,) = plan(Topology.from_facts(facts, resource), config, rdzv, device, facts)
        assert p.env[cache.variable] == "/fsx/c", (owner, device)
    facts = [WorkerFacts(node_id="n", node_ip="10.0.0.1", pid=1, accelerator_ids={"TPU": ("0",)})]
    with pytest.raises(XLAConfigError, match=r"compile_cache='s3://b' is not valid.*device='tpu'"):
        plan(Topology.from_facts(facts, "TPU"), TorchXLAConfig(compile_cache="s3://b"), rdzv, "tpu",
             facts)


@pytest.mark.parametrize("owner,fields,env", [
    ("TorchNeuronConfig", {"compile_cache": "/fsx/neff"}, {"TORCH_NEURONX_NEFF_CACHE_DIR": "/tmp/x"}),
    ("TorchXLAConfig", {"compile_cache": "s3://b/c"}, {"NEURON_COMPILE_CACHE_URL": "/tmp/x"}),
    ("TorchTPUConfig", {"compile_cache": "gs://b/c"},
     {"TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "/tmp/x"}),
    ("TorchXLAConfig", {"efa": True}, {"FI_PROVIDER": "tcp"}),
    ("TorchNeuronConfig", {"efa": True}, {"FI_EFA_FORK_SAFE": "0"}),
])
def test_an_env_entry_a_field_also_sets_is_refused_naming_both(owner, fields, env):
    """env is applied last: beside the field it would silently win. Without the field, the
    entry is the documented way to set the variable."""
    import ray_train_xla

    cls = getattr(ray_train_xla, owner)
    (var, value), = env.items()
    (field, given), = fields.items()
    with pytest.raises(XLAConfigError) as info:
        cls(**fields, env=env)
    message = str(info.value)
    assert f"{owner}.env[{var!r}]={value!r} is not valid" in message
    assert f"beside {field}={given!r}, which sets {var} too" in message
    assert cls(env=env).env == env
