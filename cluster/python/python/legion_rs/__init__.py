"""legion-rs from Python: plan and train a CNN with layer-wise parallelism.

    import torch, torchvision, legion_rs
    model = torchvision.models.resnet18(num_classes=10)
    weights = legion_rs.train(model, example_input=torch.zeros(1, 3, 64, 64), batch=16,
                              devices=4, strategy="optcnn", data="synthetic:512", steps=20)
    model.load_state_dict(weights)

``model`` is a ``torch.nn.Module`` (with ``example_input``; exported to ONNX internally with its
BatchNorm kept), an ONNX or JSON model file, or a zoo name (``zoo_names()``). ``data`` is a spec
(``"synthetic"``, ``"synthetic:N"``, ``"folder:DIR"``, ``"cifar10:DIR"``), a folder of class
subfolders as a ``pathlib.Path``, or an iterable of ``(images, labels)`` batches (numpy arrays or
torch tensors, ``[N, C, H, W]`` and ``[N]``), trained on in the order given.

Errors are raised as :class:`LegionError` with the located message of the command line; a
Ctrl-C stops the run after its current step (saving the checkpoint ``save`` asked for) and then
raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import pathlib
import sys
import tempfile
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from ._legion import LegionError, zoo_names
from . import _legion

__all__ = ["plan", "train", "Plan", "StateDict", "LegionError", "zoo_names"]

Model = Union[str, os.PathLike, Any]
Data = Union[str, os.PathLike, Iterable[Tuple[Any, Any]]]
Event = Dict[str, Any]


class Plan:
    """A searched strategy: ``print(plan)`` shows the table of ``legion-rs plan``.

    Attributes: ``search`` (the search that found it), ``eq1_ms`` and ``simulated_ms`` (its
    Eq. 1 cost and simulated step), ``comm_bytes`` (bytes moved a step), ``layers`` (per layer:
    ``layer``, ``op``, ``degrees``, ``devices``, ``t_c_ms``, ``t_s_ms``), ``searches`` (every search run, as dicts).
    """

    def __init__(self, table: str, document: str):
        self.table = table
        self._doc = json.loads(document)
        ok = [s for s in self._doc["searches"] if "eq1_ms" in s]
        best = min(ok, key=lambda s: s["eq1_ms"])
        self.search: str = best["search"]
        self.eq1_ms: float = best["eq1_ms"]
        self.simulated_ms: float = best["simulated_ms"]
        self.comm_bytes: int = best["comm_bytes"]
        self.sync_bytes: int = best["sync_bytes"]
        self.inter_node_bytes: int = best["inter_node_bytes"]
        self.peak_device_bytes: int = best["peak_device_bytes"]
        self.eq1_parts: Dict[str, Any] = best["eq1_parts"]
        costs = {c["layer"]: c for c in best["eq1_parts"]["layers"]}
        self.layers: List[Dict[str, Any]] = [
            dict(layer, t_c_ms=costs[layer["layer"]]["t_c_ms"], t_s_ms=costs[layer["layer"]]["t_s_ms"])
            for layer in best["strategy"]
        ]
        self.searches: List[Dict[str, Any]] = self._doc["searches"]

    def to_dict(self) -> Dict[str, Any]:
        """The ``legion-rs plan --json`` document."""
        return copy.deepcopy(self._doc)

    def __str__(self) -> str:
        return self.table

    def __repr__(self) -> str:
        return (f"Plan(search={self.search!r}, eq1_ms={self.eq1_ms:.3f}, "
                f"simulated_ms={self.simulated_ms:.3f}, comm_bytes={self.comm_bytes})")


class StateDict(collections.OrderedDict):
    """Trained weights under the model's own names, as ``module.load_state_dict`` takes them
    (torch tensors where torch is installed, else numpy arrays). ``summary`` holds the run's
    summary: ``losses``, ``images_per_sec``, ``plan``, ``validation``, ...
    """

    summary: Dict[str, Any]


def plan(
    model: Model,
    *,
    example_input: Any = None,
    machine: Optional[str] = None,
    devices: Optional[int] = None,
    cluster: Optional[Union[str, os.PathLike]] = None,
    cluster_state: Optional[Union[str, os.PathLike]] = None,
    batch: Optional[int] = None,
    search: str = "optcnn",
    costs: Union[str, os.PathLike] = "roofline",
    image_size: Optional[int] = None,
    classes: Optional[int] = None,
    memory_gib: Optional[float] = None,
    precision: Optional[str] = None,
    budget: Optional[int] = None,
) -> Plan:
    """Searches a strategy for ``model`` on a machine, without training.

    The machine is a preset or machine file (``machine="paper:4"``, ``"dgx-h100:8"``), the
    embedded cluster's ``devices``, or a ``cluster`` hosts file (with the links ``legion-rs up``
    measured; ``cluster_state``: its ``--state``). ``search`` is a search's name
    (``optcnn``, ``data``, ``owt``, ``refine``, ...) or ``"all"`` side by side. ``costs`` prices
    tiles by ``"roofline"``, as a profile file measured them, or (``"measured"``, for the embedded
    ``devices``) as the cost cache that training runs keep. ``batch`` is the global batch
    (default: 32 per device).
    """
    with _model_file(model, example_input) as (spec, _names):
        table, document = _legion.plan(
            spec,
            batch=batch if batch is not None else _example_batch(example_input),
            image_size=image_size,
            classes=classes,
            machine=machine,
            devices=devices,
            cluster=_path(cluster),
            cluster_state=_path(cluster_state),
            search=search,
            costs=os.fspath(costs),
            memory_gib=memory_gib,
            precision=precision,
            budget=budget,
        )
    return Plan(table, document)


def train(
    model: Model,
    data: Data = "synthetic",
    *,
    example_input: Any = None,
    batch: Optional[int] = None,
    devices: int = 1,
    cluster: Optional[Union[str, os.PathLike]] = None,
    cluster_state: Optional[Union[str, os.PathLike]] = None,
    slurm: bool = False,
    strategy: str = "optcnn",
    costs: Union[str, os.PathLike] = "measured",
    replan: bool = False,
    verify: int = 3,
    max_recoveries: int = 3,
    snapshot_every: Optional[int] = None,
    data_on_driver: bool = False,
    steps: Optional[int] = None,
    epochs: Optional[int] = None,
    lr: Optional[float] = None,
    momentum: Optional[float] = None,
    weight_decay: Optional[float] = None,
    nesterov: bool = False,
    seed: int = 1,
    device: str = "auto",
    image_size: Optional[int] = None,
    classes: Optional[int] = None,
    init: Optional[Union[str, os.PathLike]] = None,
    resume: Optional[Union[str, os.PathLike]] = None,
    save: Optional[Union[str, os.PathLike]] = None,
    checkpoint_every: Optional[int] = None,
    save_strategy: Optional[Union[str, os.PathLike]] = None,
    precision: Optional[str] = None,
    val_data: Optional[Data] = None,
    val_split: Optional[float] = None,
    eval_every: Optional[int] = None,
    memory_gib: Optional[float] = None,
    progress: Union[bool, Callable[[Event], None]] = True,
) -> StateDict:
    """Trains ``model`` on ``data`` and returns its trained weights (a :class:`StateDict`).

    Where it trains: ``devices`` of the embedded cluster (1: one device), the workers of a
    ``cluster`` hosts file started by ``legion-rs up`` (``cluster_state``: the ``--state`` it was
    given), or those of this Slurm job (``slurm``).
    ``strategy`` is a search (``optcnn``, ``data``, ``owt``, ...) or a strategy JSON file;
    ``costs`` what the search prices tiles with: ``"measured"`` (timed on the devices, kept in
    the cost cache), ``"roofline"``, or a profile file. A run that ``resume``\ s a checkpoint
    trains on with its strategy unless ``replan``. ``verify``: alternatives the run trains a
    few steps each beside the search's strategy, keeping the one measured fastest (0: none).
    On a cluster, a run that loses a worker re-plans for the devices left and trains on from its
    latest snapshot (taken every ``snapshot_every`` steps; ``None``: as often as keeps them within
    5% of the training time), at most ``max_recoveries`` times (0: a lost worker ends the run).
    Each worker reads its devices' samples of a ``data`` path itself (every host must read the
    same files there), unless ``data_on_driver``: then this process reads them and sends them.
    ``steps`` (default 100) or ``epochs`` say how long; SGD's ``lr``, ``momentum`` and
    ``weight_decay`` default to legion-rs's (0.03, 0.9, 5e-4) and step as ``torch.optim.SGD``
    does. A torch module starts from its own weights; other models from ``init``, the weights
    their file carries, or the seeded initialisation. ``progress`` is True (a bar on stderr), False,
    or a callable that receives each event as a dict (``{"event": "step", "loss": ...}``).
    ``batch`` is the global batch: default the example input's, else 32.
    """
    with _model_file(model, example_input) as (spec, names):
        callback, finish = _progress(progress)
        weights = None
        if names is not None and init is None and resume is None:
            weights = [(name, _f32(value)) for name, value in names.items()]
        fed = not isinstance(data, (str, os.PathLike))
        if fed and steps is None and epochs is None:
            if not hasattr(data, "__len__"):
                raise LegionError(f"data: a {type(data).__name__} has no len(); give steps=")
            epochs = 1
        try:
            tensors, summary = _legion.train(
                spec,
                batch=batch if batch is not None else (_example_batch(example_input) or 32),
                image_size=image_size,
                classes=classes,
                data=_data(data, epochs or 1),
                devices=devices,
                cluster=_path(cluster),
                cluster_state=_path(cluster_state),
                slurm=slurm,
                strategy=os.fspath(strategy),
                costs=os.fspath(costs),
                replan=replan,
                verify=verify,
                max_recoveries=max_recoveries,
                snapshot_every=snapshot_every,
                data_on_driver=data_on_driver,
                steps=steps,
                epochs=epochs,
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                nesterov=nesterov,
                seed=seed,
                device=device,
                weights=weights,
                init=_path(init),
                resume=_path(resume),
                save=_path(save),
                checkpoint_every=checkpoint_every,
                save_strategy=_path(save_strategy),
                precision=precision,
                val_data=_data(val_data, 1) if val_data is not None else None,
                val_split=val_split,
                eval_every=eval_every,
                memory_gib=memory_gib,
                label=f"a torch {type(model).__name__}" if names is not None else None,
                on_event=callback,
            )
        finally:
            finish()
    return _state_dict(model, tensors, summary)


def _example_batch(example_input: Any) -> Optional[int]:
    if example_input is None:
        return None
    shape = tuple(example_input.shape)
    # An example of one sample says the shape, not the batch.
    return shape[0] if shape[0] > 1 else None


def _path(value: Optional[Union[str, os.PathLike]]) -> Optional[str]:
    return None if value is None else os.fspath(value)


def _is_torch_module(model: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


@contextlib.contextmanager
def _model_file(model: Model, example_input: Any) -> Iterator[Tuple[str, Optional[Mapping[str, Any]]]]:
    """The model as ``legion-rs`` names one (a zoo name or a file) and, for a torch module, its
    weights and buffers by name."""
    if not _is_torch_module(model):
        if example_input is not None:
            raise LegionError("example_input= is for a torch.nn.Module; a zoo name or a model file fixes its own shapes")
        yield os.fspath(model), None
        return
    if example_input is None:
        raise LegionError(
            f"model: a {type(model).__name__} needs example_input=, a tensor of its input's shape "
            "(say torch.zeros(1, 3, 224, 224)), to be exported to ONNX"
        )
    with tempfile.TemporaryDirectory(prefix="legion-rs-") as tmp:
        path = os.path.join(tmp, f"{type(model).__name__.lower()}.onnx")
        try:
            _export(model, example_input, path)
        except ImportError as e:
            raise LegionError(f"exporting a torch module to ONNX needs {e.name or 'onnx'}: pip install onnx") from e
        except Exception as e:
            if type(e).__name__ == "OnnxExporterError" and "onnx is not installed" in str(e):
                raise LegionError("exporting a torch module to ONNX needs the onnx package: pip install onnx") from e
            raise
        state = {name: t for name, t in model.state_dict().items()
                 if not name.endswith("num_batches_tracked")}
        yield path, state


def _export(model: Any, example_input: Any, path: str) -> None:
    """Exports ``model`` as a graph-only ONNX file whose graph inputs are named by its
    state_dict: a copy with every parameter and buffer set to distinct values (PyTorch's exporter
    merges equal ones, a fresh BatchNorm's ones and zeros, under one name), in eval mode (BatchNorm
    kept as a node by ``TrainingMode.PRESERVE``) but for its Dropout modules (kept as Dropout nodes
    only in training mode)."""
    import torch

    fresh = copy.deepcopy(model).cpu()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in list(fresh.parameters()) + list(fresh.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
    fresh.eval()
    for module in fresh.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.train()
    example = torch.zeros((1,) + tuple(example_input.shape[1:]), dtype=torch.float32)
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            fresh,
            (example,),
            path,
            dynamo=False,
            export_params=False,
            opset_version=17,
            training=torch.onnx.TrainingMode.PRESERVE,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )


def _f32(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(value, dtype=np.float32)


def _data(data: Data, passes: int) -> Any:
    """A data spec as the command line takes it, or ``passes`` passes over an iterable of
    batches as float32/int64 numpy batches."""
    if isinstance(data, str):
        return data
    if isinstance(data, os.PathLike):
        return f"folder:{os.fspath(data)}"
    if passes > 1 and iter(data) is data:
        raise LegionError(
            f"data: a {type(data).__name__} is an iterator, passed over once; for epochs={passes} "
            "give an iterable that can be passed over again (a list, a DataLoader)"
        )
    return _Batches(data, passes)


class _Batches:
    """``passes`` passes over ``(images, labels)`` batches of any array type, as C-contiguous
    float32 and int64 numpy arrays; the iterable's ``len`` (one pass's) kept where it has one."""

    def __init__(self, iterable: Iterable[Tuple[Any, Any]], passes: int):
        self._iterable = iterable
        self._passes = passes

    def __iter__(self) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        for _ in range(self._passes):
            for item in self._iterable:
                try:
                    images, labels = item
                except (TypeError, ValueError):
                    raise LegionError(
                        f"data: each batch must be an (images, labels) pair, got {type(item).__name__}"
                    ) from None
                yield _f32(images), np.ascontiguousarray(_numpy(labels), dtype=np.int64)

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]


def _numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


def _progress(progress: Union[bool, Callable[[Event], None]]) -> Tuple[Optional[Callable[[Event], None]], Callable[[], None]]:
    """The callback the run reports to, and what ends its display."""
    if callable(progress):
        return progress, lambda: None
    if not progress:
        return None, lambda: None
    bar = _Bar()
    return bar.update, bar.close


class _Bar:
    """A progress bar on stderr: tqdm's where tqdm is installed, else one line redrawn."""

    def __init__(self) -> None:
        self._tqdm = None
        self._line = False

    def update(self, event: Event) -> None:
        kind = event["event"]
        if kind in ("device", "note"):
            self._say(event["line"])
        elif kind == "warning":
            warnings.warn(event["line"], stacklevel=2)
        elif kind == "planned":
            self._say(f"{event['choice']} on {event['devices']} {event['place']}, "
                      f"{event['remote_bytes'] / 1e6:.1f} MB moved a step")
        elif kind == "step":
            self._step(event)
        elif kind == "evaluated":
            self._say(f"step {event['step']}: held-out top-1 {event['top1'] * 100:.2f}%, "
                      f"top-5 {event['top5'] * 100:.2f}%, loss {event['loss']:.4f}")

    def _step(self, event: Event) -> None:
        text = f"loss {event['loss']:.4f}, {event['images_per_sec']:.1f} images/s"
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            if self._tqdm is None:
                self._tqdm = tqdm(total=event["total_steps"], initial=event["step"] - 1, unit="step")
            self._tqdm.set_postfix_str(text, refresh=False)
            self._tqdm.update(1)
            return
        sys.stderr.write(f"\rstep {event['step']}/{event['total_steps']}: {text}   ")
        sys.stderr.flush()
        self._line = True

    def _say(self, line: str) -> None:
        if self._tqdm is not None:
            self._tqdm.write(line, file=sys.stderr)
            return
        if self._line:
            sys.stderr.write("\n")
            self._line = False
        print(line, file=sys.stderr)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._line:
            sys.stderr.write("\n")
            self._line = False


def _state_dict(model: Model, tensors: List[Tuple[str, np.ndarray]], summary: Dict[str, Any]) -> StateDict:
    """The trained tensors in the module's own state_dict order (torch tensors where torch is
    installed); a torch module's ``num_batches_tracked`` counters advanced by the steps taken, as
    PyTorch's training steps advance them."""
    trained = dict(tensors)
    out = StateDict()
    torch = sys.modules.get("torch")
    if _is_torch_module(model):
        taken = summary["steps"] - summary["first_step"]
        for name, value in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                out[name] = value.detach().clone() + taken
            elif name in trained:
                out[name] = torch.from_numpy(trained.pop(name)).to(value.dtype)
            else:
                raise LegionError(f"the trained model has no tensor '{name}' of the module's state_dict")
    else:
        for name, value in tensors:
            out[name] = torch.from_numpy(value) if torch is not None else value
    out.summary = summary
    return out
