"""Parameters and optimizer state split over a mesh (``linattn_jax.sharding``): the rules,
the layers' names, and, on 8 forced CPU devices, FSDP, FSDP x tensor and data x FSDP x
sequence training that gives the single-device losses, really splits every array,
compiles to the collectives of its kind and resumes on another mesh."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from experiments import trainer
from linattn_jax import models, sharding
from tests import helpers
from tests.test_experiments import tiny_config

# Data x sequence parallel through the trainer (in the 8-device process with the meshes below,
# rather than a process of its own): the gated delta rule's sequence-parallel form.
SEQUENCE_CONFIG = ["seq_len=32", "steps=3", "batch_size=8", "model.attention=gated_deltanet"]

MESH = AbstractMesh((2, 4, 1, 2), ("data", "fsdp", "sequence", "tensor"))

# The model every check trains: its attention, MLP and embedding matrices of distinct
# shapes (an all-gather's shape names its parameter), a vocabulary the tensor axis divides.
CONFIG = [
    "seq_len=32",
    "steps=3",
    "batch_size=8",
    "log_every=1",
    "eval_every=3",
    "eval_batches=1",
    "model.width=32",
    "model.num_heads=4",
    "model.mlp_ratio=3",
    "mqar.vocab_size=80",
]


@pytest.fixture(autouse=True)
def _standard_promotion():
    """optax's Adam mixes int and float scalars (as in tests/test_experiments.py)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.parametrize(
    "names,shape,expected",
    [
        (("embed", "heads"), (32, 64), PartitionSpec("fsdp", "tensor")),
        (("heads", "embed"), (64, 32), PartitionSpec("tensor", "fsdp")),
        (("vocab", "embed"), (9, 32), PartitionSpec(None, "fsdp")),  # 9 % 2: replicated
        (("embed", "mlp"), (6, 32), PartitionSpec(None, "tensor")),  # 6 % 4
        (("embed", "embed"), (32, 32), PartitionSpec("fsdp", None)),  # an axis used once
        (("layers", "embed", "heads"), (3, 32, 64), PartitionSpec(None, "fsdp", "tensor")),
        (("batch", "length", None), (8, 32, 16), PartitionSpec(("data", "fsdp"), None, None)),
        (("norm",), (32,), PartitionSpec(None)),  # no rule: replicated
        (("tensor", None), (32, 32), PartitionSpec("tensor", None)),  # a mesh axis itself
        ((), (32, 32), PartitionSpec()),  # unnamed
    ],
)
def test_partition_spec_places_named_dims_or_replicates_them(names, shape, expected):
    assert sharding.partition_spec(names, shape, MESH) == expected


def test_partition_spec_refuses_names_of_another_rank():
    with pytest.raises(ValueError, match=r"blocks/0/kernel has shape \(3, 32, 64\) but its "):
        sharding.partition_spec(("embed", "heads"), (3, 32, 64), MESH, where="blocks/0/kernel")


@pytest.mark.parametrize("scan_layers", [False, True])
def test_layers_name_their_parameters_and_place_nothing(scan_layers):
    model = models.LanguageModel(
        80, 16, 2, 2, attention="2 linear : 1 softmax" if not scan_layers else "linear",
        mlp="swiglu", scan_layers=scan_layers, rngs=nnx.Rngs(0),
    )  # fmt: skip
    specs = nnx.get_partition_spec(nnx.state(model))
    layers = ("layers",) if scan_layers else ()
    attention = specs["blocks"][0]["attention"]
    assert tuple(attention["q_proj"]["kernel"].get_value()) == (*layers, "embed", "heads")
    assert tuple(attention["out_proj"]["kernel"].get_value()) == (*layers, "heads", "embed")
    mlp = specs["blocks"][0]["mlp"]
    assert tuple(mlp["down_proj"]["kernel"].get_value()) == (*layers, "mlp", "embed")
    assert tuple(specs["embed"]["embedding"].get_value()) == ("vocab", "embed")
    # Built without a mesh: on one device, as before the names.
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(nnx.state(model))} == {1}


def _train_steps(config, steps: int = 3):
    """The train losses of ``steps`` steps of ``config`` on its mesh (and the state after)."""
    task = trainer.build_task(config)
    sharder = trainer.Sharder.of(config)
    with jax.set_mesh(sharder.mesh):
        model, optimizer = trainer.create_state(config, sharder)
        losses = []
        for step in range(steps):
            batch = sharder.put_batch(task.batch(step, "train"))
            losses.append(float(trainer.train_step(model, optimizer, *batch, task.kind)["loss"]))
    return losses, model, optimizer, sharder, task


_SCRIPT = """
import json, math, re, sys
import jax
import pytest
import numpy as np
from flax import nnx
from experiments import checkpoints, trainer
from tests.test_experiments import record_train_batches, tiny_config
from linattn_jax import sharding
from tests.test_sharding import CONFIG, SEQUENCE_CONFIG, _train_steps

assert jax.device_count() == 8
out = {"errors": []}
for bad in (["mesh.fsdp=3"], ["mesh.fsdp=2", "mesh.tensor=3"], ["mesh.fsdp=4", "batch_size=6"],
            ["mesh.tensor=2", "mesh.sequence=2"]):
    try:
        trainer.validate(tiny_config("configs/mqar.py:small", *CONFIG, *bad))
    except ValueError as e:
        out["errors"].append(str(e))


def split_by(spec, mesh):
    return math.prod(mesh.shape[a] for d in spec if d for a in ((d,) if isinstance(d, str) else d))


def collectives(model, optimizer, sharder, task):
    batch = sharder.put_batch(task.batch(0, "train"))
    with jax.set_mesh(sharder.mesh):
        hlo = trainer.train_step.lower(model, optimizer, *batch, task.kind).compile().as_text()
    results = re.findall(r"= (\\S+|\\([^=]*\\)) all-gather\\(", hlo)  # one array or a tuple
    shapes = [s for r in results for s in re.findall(r"\\w+\\[([\\d,]*)\\]", r)]
    # The computations that the loops run (the chunk scans, forward and backward).
    bodies = {c: b for c, b in re.findall(r"(?ms)^%?([\\w.-]+) [^\\n]*\\{\\n(.*?)^\\}", hlo)}
    called = lambda text: re.findall(r"(?:calls|to_apply|body|condition)=%?([\\w.-]+)", text)
    looped, todo = set(), re.findall(r"body=%?([\\w.-]+)", hlo)
    while todo:
        if (c := todo.pop()) not in looped:
            looped.add(c)
            todo += called(bodies.get(c, ""))
    collective = r" (?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\\("
    return {
        "all-gather": sorted({tuple(int(n) for n in s.split(",") if n) for s in shapes}),
        "reduce": len(re.findall(r" (?:reduce-scatter|all-reduce)\\(", hlo)),
        "loops": len(looped),
        "in_loops": sum(len(re.findall(collective, bodies.get(c, ""))) for c in looped),
    }


for name, mesh in {
    "fsdp8": ["mesh.fsdp=8"],
    "fsdp4_tensor2": ["mesh.fsdp=4", "mesh.tensor=2"],
    "data2_fsdp2_sequence2": ["mesh.fsdp=2", "mesh.sequence=2"],
}.items():
    config = tiny_config("configs/mqar.py:small", *CONFIG, *mesh)
    losses, model, optimizer, sharder, task = _train_steps(config)
    arrays = []
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state((model, optimizer))):
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        arrays.append({
            "path": jax.tree_util.keystr(path, simple=True, separator="/"),
            "shape": x.shape,
            "spec": [list(d) if isinstance(d, tuple) else d for d in spec],
            "split": split_by(spec, sharder.mesh),
            "shard": [int(n) for n in x.addressable_shards[0].data.shape],
            "devices": len(x.sharding.device_set),
        })
    params = nnx.state(model, nnx.Param)
    out[name] = {"losses": losses, "arrays": arrays, "param_bytes": sharding.shard_bytes(params)}
    if name != "data2_fsdp2_sequence2":
        out[name]["collectives"] = collectives(model, optimizer, sharder, task)

# Gated DeltaNet through the trainer on data x sequence (4 along the sequence).
config = tiny_config("configs/mqar.py:small", *SEQUENCE_CONFIG, "mesh.sequence=4")
out["sequence4"] = trainer.train(config, sys.argv[2])

# Saved on FSDP 4 (x tensor 2) after step 2, resumed on FSDP 2 (x data 2 x sequence 2): its
# first batch is step 3's. (The meshes above: their steps are compiled already.)
workdir = sys.argv[1]
asked = record_train_batches(pytest.MonkeyPatch())  # for the rest of this process
fsdp4 = ["mesh.fsdp=4", "mesh.tensor=2", "stop_at=2"]
trainer.train(tiny_config("configs/mqar.py:small", *CONFIG, *fsdp4), workdir)
asked.clear()
fsdp2 = ["mesh.fsdp=2", "mesh.sequence=2"]
trainer.train(tiny_config("configs/mqar.py:small", *CONFIG, *fsdp2), workdir)
rows = [json.loads(line) for line in open(workdir + "/metrics.jsonl")]
# The sharded checkpoint loads onto one device, for sampling.
loaded, _ = checkpoints.load(workdir)
out["resumed"] = {
    "first_step": asked[0] + 1,
    "loss": [r["loss"] for r in rows if r["split"] == "train" and r["step"] == 3],
    "loaded_devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(nnx.state(loaded))}),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory) -> dict:
    """What ``_SCRIPT`` measured on 8 forced CPU devices."""
    workdirs = [str(tmp_path_factory.mktemp(name)) for name in ("resume", "sequence")]
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), *workdirs],
        env=helpers.device_env(8),
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


MESHES = ("fsdp8", "fsdp4_tensor2", "data2_fsdp2_sequence2")


def test_meshes_that_cannot_run_are_refused_naming_the_fields(eight_devices):
    assert eight_devices["errors"] == [
        "mesh.fsdp=3 must divide the 8 devices (the data axis takes the rest)",
        "mesh.fsdp=2 x mesh.tensor=3 = 6 must divide the 8 devices (the data axis takes the rest)",
        "batch_size=6 must be divisible by the 8 devices of the data and fsdp axes",
        "mesh.tensor=2 with mesh.sequence=2: the sequence-parallel layers do not split heads "
        "yet; use one of them",
    ]


def test_sharded_training_gives_the_single_device_losses(eight_devices):
    assert jax.device_count() == 1
    single, *_ = _train_steps(tiny_config("configs/mqar.py:small", *CONFIG))
    for name in MESHES:
        np.testing.assert_allclose(eight_devices[name]["losses"], single, rtol=1e-5, err_msg=name)
    # Resumed on another mesh: the step after the saved one, with the loss it had unbroken.
    assert eight_devices["resumed"]["first_step"] == 3
    assert eight_devices["resumed"]["loaded_devices"] == [1]  # experiments.load
    np.testing.assert_allclose(eight_devices["resumed"]["loss"], single[2:], rtol=1e-5)


@pytest.mark.slow
def test_sequence_parallel_training_gives_the_single_device_loss(eight_devices, tmp_path):
    """Data x sequence parallel (8 devices, 4 along the sequence) through the trainer: the
    single-device loss and accuracy (the meshes above train the additive layer)."""
    assert jax.device_count() == 1
    single = trainer.train(tiny_config("configs/mqar.py:small", *SEQUENCE_CONFIG), tmp_path)
    many = eight_devices["sequence4"]
    np.testing.assert_allclose(many["loss"], single["loss"], rtol=1e-5)
    np.testing.assert_allclose(many["accuracy"], single["accuracy"], rtol=1e-5)


def _arrays(run: dict) -> dict:
    return {a["path"]: a for a in run["arrays"]}


@pytest.mark.parametrize(
    "name,kernel,mlp",
    [
        ("fsdp8", ["fsdp", None], [None, "fsdp"]),
        ("fsdp4_tensor2", ["fsdp", "tensor"], ["tensor", "fsdp"]),
        ("data2_fsdp2_sequence2", ["fsdp", None], [None, "fsdp"]),
    ],
)
def test_parameters_and_moments_are_split(eight_devices, name, kernel, mlp):
    arrays = _arrays(eight_devices[name])
    for prefix in ("0/", "1/opt_state/1/0/mu/", "1/opt_state/1/0/nu/"):  # model, Adam's moments
        q = arrays[prefix + "blocks/0/attention/q_proj/kernel/value"]
        down = arrays[prefix + "blocks/0/mlp/down/kernel/value"]
        assert (q["spec"], down["spec"]) == (kernel, mlp), prefix
    for a in arrays.values():
        # Each device holds 1/n of the elements its spec names n devices for.
        assert np.prod(a["shard"]) * a["split"] == np.prod(a["shape"]), a["path"]
        assert a["devices"] == 8
    # Every matrix is split, everywhere it lives, but the short convolution's ([4, width]:
    # split by channels, XLA would reshard the activations around it instead).
    matrices = [a for a in arrays.values() if len(a["shape"]) == 2 and "/conv/" not in a["path"]]
    assert matrices and all(a["split"] >= 2 for a in matrices), name
    split = 8 if name == "fsdp4_tensor2" else (8 if name == "fsdp8" else 2)
    assert arrays["0/blocks/0/attention/q_proj/kernel/value"]["split"] == split
    # sharding.shard_bytes counts what one device holds: each parameter's 1/n.
    params = [a for path, a in arrays.items() if path.startswith("0/")]
    held = sum(4 * np.prod(a["shape"]) // a["split"] for a in params)  # float32
    assert eight_devices[name]["param_bytes"] == held < sum(4 * np.prod(a["shape"]) for a in params)


def test_the_compiled_step_gathers_fsdp_shards_and_no_tensor_split_parameter(eight_devices):
    fsdp = eight_devices["fsdp8"]
    gathered = {tuple(s) for s in fsdp["collectives"]["all-gather"]}
    params = {p: a for p, a in _arrays(fsdp).items() if p.startswith("0/blocks/")}
    # FSDP: each block matrix is gathered whole from its shards (in its layout or the
    # transposed one) for the step, and its gradient reduced back.
    for path, a in params.items():
        if len(a["shape"]) == 2 and "/conv/" not in path:
            full = tuple(a["shape"])
            assert full in gathered or full[::-1] in gathered, path
    assert fsdp["collectives"]["reduce"] > 0
    # Tensor x FSDP: gathers along fsdp only; no tensor-split matrix is ever gathered whole.
    both = eight_devices["fsdp4_tensor2"]
    gathered = {tuple(s) for s in both["collectives"]["all-gather"]}
    tensor_split = [a for a in _arrays(both).values() if "tensor" in a["spec"]]
    assert len(tensor_split) >= 3 * 6  # q, k, v, out, up, down, embedding; and moments
    for a in tensor_split:
        full = tuple(a["shape"])
        assert full not in gathered and full[::-1] not in gathered, a["path"]
    # The recurrences run on each device's heads: no collective inside the chunk scans.
    for run in (fsdp, both):
        assert run["collectives"]["loops"] >= 2 and run["collectives"]["in_loops"] == 0
    # ... while their fsdp shards are gathered (half the heads, all the width).
    q = _arrays(both)["0/blocks/0/attention/q_proj/kernel/value"]
    assert (q["shape"][0], q["shape"][1] // 2) in gathered
