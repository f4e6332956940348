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
