"""legion-rs against PyTorch: a torch module trained by legion-rs takes the steps
torch.optim.SGD takes from the same weights on the same batches, under any strategy."""

import copy
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import legion_rs

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def small_cnn(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def batches(torch, count, batch=8, size=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(count)]


def torch_steps(torch, model, data, lr, momentum, weight_decay, nesterov):
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, dampening=0,
                          weight_decay=weight_decay, nesterov=nesterov)
    for images, labels in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("nesterov", [False, True])
def test_legion_takes_torch_sgds_steps_from_the_same_weights(torch, nesterov):
    model = small_cnn(torch)
    data = batches(torch, 4)
    sgd = dict(lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=nesterov)
    expected = torch_steps(torch, model, data, **sgd)
    runs = [(1, "optcnn"), (4, "optcnn"), (4, "data")]
    for devices, strategy in runs:
        trained = legion_rs.train(model, data, example_input=data[0][0], devices=devices,
                                  strategy=strategy, device="cpu", progress=False, **sgd)
        assert list(trained) == list(expected), "the module's own names, in its order"
        for name, want in expected.items():
            got = trained[name]
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5,
                                       msg=lambda m: f"{devices} {strategy} {name}: {m}")
        fresh = copy.deepcopy(model)
        fresh.load_state_dict(trained)


def test_a_module_without_an_example_input_is_refused(torch):
    with pytest.raises(legion_rs.LegionError, match="example_input="):
        legion_rs.train(small_cnn(torch), batch=4, progress=False)


def test_the_readmes_python_section_runs(torch, tmp_path):
    """The README's Python program, as a user would run it, with a folder of images beside it."""
    text = README.read_text()
    section = text.split("## From Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(10):
        folder = tmp_path / "images" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 255, (48, 56, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.png")
    script = tmp_path / "readme.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "optcnn" in run.stdout, run.stdout
