"""Version shims: every branch on the jax version and every private jax import lives here.

Supported: jax >= 0.11.2 (the GPU machines run 0.11.2; CI here runs the newest release).
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset[str]:
    """Mesh axes over which `x` varies inside `jax.shard_map` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.12: ManualAxisType
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # jax 0.11


def mark_varying(x, axes):
    """Types `x` as varying over `axes` (FFI results come back typed as not varying)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # jax 0.11


def manual_axes() -> frozenset[str]:
    """Mesh axes that are manual in the enclosing `jax.shard_map` (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return frozenset()
    return frozenset(mesh.manual_axes)


def context_mesh_shape() -> dict[str, int]:
    """Axis name -> size of the mesh of the enclosing `jax.shard_map` (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return {}
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def is_batched(x) -> bool:
    """Whether `x` is being traced under `jax.vmap`."""
    from jax._src.interpreters import batching  # noqa: PLC0415  (private: isolated here)

    return isinstance(x, batching.BatchTracer)


def kv_exchange(prefix: str, rank: int, mine: bytes, count: int, timeout_ms: int) -> list[bytes]:
    """Publishes `mine` for `rank` in the jax.distributed key-value store and returns all `count`
    ranks' values (the CUDA transport's window handles across processes). Private JAX API."""
    from jax._src import distributed  # noqa: PLC0415

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jax_hybridep: the EP group spans processes but jax.distributed is not initialised"
        )
    client.key_value_set_bytes(f"{prefix}/{rank}", mine, allow_overwrite=True)
    return [client.blocking_key_value_get_bytes(f"{prefix}/{r}", timeout_ms) for r in range(count)]


def on_gpu_stream(fn, stream):
    """fn() traced onto GPU stream `stream` ("collective" or an int >= 1) with XLA's stream
    annotation (`jax.experimental.compute_on`), its results in device memory."""
    from jax._src import core  # noqa: PLC0415
    from jax.experimental.compute_on import compute_on  # noqa: PLC0415

    placed = compute_on(
        fn, compute_type=f"gpu_stream:{stream}", out_memory_spaces=core.MemorySpace.Device
    )
    return placed()


def profile_data(xplane_path: str):
    """The trace in an .xplane.pb file as `ProfileData` (public in jax.profiler on newer jax)."""
    data = getattr(jax.profiler, "ProfileData", None)
    if data is None:
        from jax._src.profiler import ProfileData as data  # noqa: PLC0415  (jax 0.11)
    return data.from_file(xplane_path)


def register_ffi_state_type(name: str, registration: dict, platform: str) -> None:
    """Registers the type of a stateful FFI handler's state ({"type_id", "type_info"} capsules)
    for `platform`, before its handlers.

    On CPU, XLA:CPU's type handler is installed first (a private jaxlib attribute): until the CPU
    backend starts, registrations are queued and replayed handlers first, and XLA then refuses a
    stateful handler ("Types used by FFI handlers must be registered before the handler
    registration", jaxlib 0.12). The GPU plugins install their type handler before their handlers.
    """
    if platform == "cpu":
        from jax._src.lib import xla_client  # noqa: PLC0415  (private: isolated here)

        xla_client.register_custom_type_handler("cpu", xla_client._xla.register_custom_type)
    jax.ffi.register_ffi_type(name, registration, platform=platform)
