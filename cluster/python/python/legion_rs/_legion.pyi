"""The native half of legion_rs (Rust, over the `legion` crate). Use the functions of
`legion_rs` itself: they take torch modules, paths and iterables and return Plan and StateDict."""

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

class LegionError(RuntimeError):
    """What legion-rs refused or what went wrong, located as the command line says it."""

def plan(
    model: str,
    *,
    batch: Optional[int] = None,
    image_size: Optional[int] = None,
    classes: Optional[int] = None,
    machine: Optional[str] = None,
    devices: Optional[int] = None,
    cluster: Optional[str] = None,
    cluster_state: Optional[str] = None,
    search: str = "optcnn",
    costs: str = "roofline",
    memory_gib: Optional[float] = None,
    precision: Optional[str] = None,
    budget: Optional[int] = None,
) -> Tuple[str, str]:
    """The plan's report as `legion-rs plan` prints it, and its `--json` document."""

def train(
    model: str,
    *,
    batch: int,
    image_size: Optional[int] = None,
    classes: Optional[int] = None,
    data: Optional[Any] = None,
    devices: int = 1,
    cluster: Optional[str] = None,
    cluster_state: Optional[str] = None,
    slurm: bool = False,
    strategy: str = "optcnn",
    costs: str = "measured",
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
    weights: Optional[List[Tuple[str, np.ndarray]]] = None,
    init: Optional[str] = None,
    resume: Optional[str] = None,
    save: Optional[str] = None,
    checkpoint_every: Optional[int] = None,
    save_strategy: Optional[str] = None,
    precision: Optional[str] = None,
    val_data: Optional[Any] = None,
    val_split: Optional[float] = None,
    eval_every: Optional[int] = None,
    memory_gib: Optional[float] = None,
    label: Optional[str] = None,
    on_event: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> Tuple[List[Tuple[str, np.ndarray]], Dict[str, Any]]:
    """Trains; `data` is a spec string or an iterable of float32 [N, C, H, W] and int64 [N]
    numpy batches. Returns the trained tensors in the model's order and the run's summary."""

def zoo_names() -> List[str]:
    """The names of the zoo's models."""
