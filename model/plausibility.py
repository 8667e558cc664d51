"""Physics a telemetry record must obey before it is stored: a measurement that breaks one of
these rules cannot be real and is quarantined with the reason by the store :func:`telemetry_store` opens.

Rules (``rec`` a :class:`memfit.schema.TelemetryRecord`, bytes per device):

* ``peak_allocated_bytes`` at least the weights its own configuration keeps resident through the step
  (:func:`model.analytic.model_state_bytes` — sharded by ZeRO-3/FSDP, 0 when parameters are offloaded; the
  gradients and optimizer states are not counted, since a step may peak before they exist), less
  :data:`FLOOR_SLACK` for weights PyTorch ties or the shapes overcount;
* ``peak_allocated_bytes`` at least ``memory_after_init_bytes`` and ``memory_after_forward_bytes`` (the
  peak is the maximum over a window that holds both), less :data:`ORDER_SLACK_BYTES`;
* ``recomputed_layers`` at most ``num_layers`` (a layer recomputes its forward once per backward);
* ``step_time_s`` above 0 when given (a step that ran took time).
"""

from __future__ import annotations

from data.store import TelemetryStore
from memfit.schema import TelemetryRecord

FLOOR_SLACK = 0.9  # shipped rows: lowest peak is 1.087x the estimate; 10 % slack (tied embeddings, shape overcount)
ORDER_SLACK_BYTES = 1 << 20  # 1 MiB: allocator rounding between the snapshots and the peak counter


def physics_violation(rec: TelemetryRecord) -> str | None:
    """The first rule above that ``rec`` breaks, as a sentence naming the fields and values; None when none."""
    from model.analytic import model_state_bytes

    m, L = rec.measurement, rec.model.num_layers
    if m.recomputed_layers is not None and m.recomputed_layers > L:
        return (
            f"recomputed_layers={m.recomputed_layers} exceeds num_layers={L}: a layer recomputes its "
            "forward at most once per backward"
        )
    if m.step_time_s is not None and m.step_time_s <= 0:
        return f"step_time_s={m.step_time_s} must be above 0 for a step that ran"
    peak = m.peak_allocated_bytes
    weights = 0 if m.oom else model_state_bytes(rec.model, rec.training, zero1_lower_bound=True).weights_bytes
    if peak < FLOOR_SLACK * weights:  # an OOM row may have died before its weights were all placed
        return (
            f"peak_allocated_bytes={peak} is below the {weights} bytes of weights this configuration keeps "
            f"on the device ({FLOOR_SLACK:g}x allowed): the peak holds at least the model's weights"
        )
    for name in ("memory_after_init_bytes", "memory_after_forward_bytes"):
        value = getattr(m, name)
        if value is not None and peak + ORDER_SLACK_BYTES < value:
            return (
                f"peak_allocated_bytes={peak} is below {name}={value}: the peak is the maximum over a "
                "window that holds that moment"
            )
    return None


def telemetry_store(url: str | None = None, **kwargs) -> TelemetryStore:
    """The telemetry store every writer opens: :class:`data.store.TelemetryStore` at ``url`` (its default when
    None) with :func:`physics_violation` as its ``physics`` rules; ``kwargs`` go to the store (``busy_timeout_s``).

    Raises:
        OSError / sqlalchemy.exc.OperationalError: as :class:`data.store.TelemetryStore`.
    """
    return TelemetryStore(url, physics=physics_violation, **kwargs)
