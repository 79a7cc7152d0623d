"""Every KServe v2 / Triton HTTP route of the ingress but slot inference, in one transport-neutral place.

:func:`http_route` takes a request as plain values (method, path below the
app's prefix, query, headers, body) and returns the answer (status, headers,
body): whichever listener received it (Serve's proxy, or any other) sends
that answer as it is. What each route gets:

* Forwarded to the node's Triton over loopback HTTP, its answer returned as
  it is (status, body, protocol headers; segment keys redacted from errors):
  health, model metadata, ready, config, statistics, the repository index,
  versioned inference (after refusing shared-memory parameters), ``generate``
  and ``generate_stream``, and log and trace settings *read* (a ``GET``, or a
  ``POST`` of an empty object).
* Answered here: server metadata (``triton``, Triton's version, the
  extensions this ingress serves) and shared-memory status for the caller:
  no regions (the app's own slot regions never show), unregister a no-op.
* Repository load and unload: forwarded when the node's Triton runs with
  explicit model control (then the node re-reads the model's configuration
  for its slot pools), else refused (:class:`ModelControlRefusedError`, 503).
  A load that sends model files (``file:<path>`` parameters) is refused (501):
  the files would be written to and run on the node (and Triton 2.51 aborts
  on a path component longer than ``NAME_MAX``); a ``config`` override is
  forwarded.
* Refused with a typed error that says why and what to use instead:
  shared-memory registration (:class:`SharedMemoryRefusedError`, 501) and log
  or trace settings changes (:class:`SettingsRefusedError`, 501).
* A known route asked with another method: Triton's 405; any other path:
  Triton's 404 (``{"error": "Not Found"}``).

Slot inference (``POST /v2/models/<m>/infer``) is the listener's own fast path
(:func:`infer_route` says which requests those are); a listener that hands
one to :func:`http_route` gets Triton's own answer over loopback instead.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray_triton_shm._private.serve.net import bounded
from ray_triton_shm._private.serve.protocol import kserve, kserve_errors
from ray_triton_shm._private.shm.segment import redact
from ray_triton_shm.errors import (
    InputError,
    ModelControlRefusedError,
    RayTritonShmError,
    SettingsRefusedError,
    SharedMemoryRefusedError,
)

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
"""How long a health or readiness probe waits for the node's Triton before answering "not ready"."""
PROXY_TIMEOUT_S = 60.0
"""How long other forwarded requests wait for the node's Triton."""
CONTROL_TIMEOUT_S = 600.0
"""How long a forwarded model load or unload waits (Triton answers once the model is loaded)."""

SERVER_NAME = "triton"
"""The server name Triton reports, and so this ingress."""

_BASE_EXTENSIONS = ("model_configuration", "binary_tensor_data", "statistics")
_REPOSITORY_EXTENSIONS = ("model_repository", "model_repository(unload_dependents)")


def extensions(explicit_model_control: bool) -> list[str]:
    """The KServe v2 / Triton extensions this ingress serves, in Triton's order.

    Not listed, because the slot path does not honour them or the ingress
    refuses them: ``classification`` (an output asked for as its top classes
    is refused, 501), ``sequence``, ``schedule_policy``,
    ``parameters`` (request parameters other than ``binary_data_output``),
    ``system_shared_memory`` and ``cuda_shared_memory`` (registration is
    refused), ``trace`` and ``logging`` (settings can be read, not changed).
    The repository extensions are listed only where loads and unloads are
    forwarded (explicit model control).
    """
    listed = list(_REPOSITORY_EXTENSIONS) if explicit_model_control else []
    return [*listed, *_BASE_EXTENSIONS]


class RouteNode(Protocol):
    """What the routes need of the replica's node.

    Attributes:
        info: How to reach the node's Triton now (``http_url``, ``grpc_url``,
            ``version``); read on every request, since Triton may restart elsewhere.
        explicit_model_control: Whether the node's Triton accepts loads and unloads.
        max_request_bytes: Largest request body (and inflated body) the ingress accepts.
    """

    @property
    def info(self) -> Any: ...

    @property
    def explicit_model_control(self) -> bool: ...

    @property
    def max_request_bytes(self) -> int: ...

    async def model_changed(self, model: str) -> None:
        """The model was loaded or unloaded through the ingress: re-read its configuration."""


class IngressNode:
    """:class:`RouteNode` of a :class:`NodeClient`: its node's Triton.

    Args:
        client: The replica's client of its node (``info``, ``model_changed``).
        explicit_model_control: See :attr:`ServerConfig.explicit_model_control`.
        max_request_bytes: See :attr:`NodeConfig.max_request_bytes`.
    """

    def __init__(self, client: Any, explicit_model_control: bool, max_request_bytes: int) -> None:
        self._client = client
        self._explicit = explicit_model_control
        self._max_request_bytes = max_request_bytes

    @property
    def info(self) -> Any:
        return self._client.info

    @property
    def explicit_model_control(self) -> bool:
        return self._explicit

    @property
    def max_request_bytes(self) -> int:
        return self._max_request_bytes

    async def model_changed(self, model: str) -> None:
        await asyncio.to_thread(self._client.model_changed, model)


@dataclass(frozen=True)
class HttpAnswer:
    """An HTTP answer: status, headers (lower-case names) and body."""

    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=lambda: {"content-type": "application/json"})


# -- what the refusals say ----------------------------------------------------------------------


def shm_registration_refused(kind: str) -> SharedMemoryRefusedError:
    """The refusal of a ``kind`` (``system`` or ``cuda``) shared-memory registration."""
    return SharedMemoryRefusedError(
        f"{kind} shared-memory registration is not supported by this endpoint: the server's shared "
        "memory lies on its own node and belongs to the app (its slot pools), so a client cannot "
        "register regions here. Send tensors in the request instead (binary tensor data over HTTP, "
        "raw_input_contents over gRPC); a caller inside the Ray cluster can write into the app's "
        "slots directly with ray_triton_shm's NodeClient or SlotRefCaller"
    )


def model_control_refused(action: str, model: str) -> ModelControlRefusedError:
    """The refusal of a load or unload where the node's Triton loads its repository only at start."""
    return ModelControlRefusedError(
        f"cannot {action} model '{model}': the node's Triton does not run with explicit model "
        "control, so its models are the repository's, loaded at start. Run the app with "
        "server: {model_control: explicit} to load and unload models through this endpoint "
        "(or ray-triton-shm models on the cluster)",
        "UNAVAILABLE",
    )


FILE_PARAMETER_PREFIX = "file:"
"""Load parameters named ``file:<path>`` carry model files to write into the node's repository."""


def model_files_refused(model: str) -> ModelControlRefusedError:
    """The refusal of a load that sends model files (``file:<path>`` parameters)."""
    return ModelControlRefusedError(
        f"cannot load model '{model}' from files sent in the request: this endpoint does not accept "
        "model files (they would be written to, and run on, the node's Triton). Put the model in the "
        "app's model repository and load it by name, with a config parameter to override its "
        "configuration"
    )


def settings_refused(what: str) -> SettingsRefusedError:
    """The refusal of a change to the node Triton's ``what`` (``log`` or ``trace``) settings."""
    return SettingsRefusedError(
        f"changing {what} settings is not supported by this endpoint: they belong to the node's "
        "Triton, which every app and client on that node shares, and can name files on it. Reading "
        f"them works (no settings in the request); set them where the app is configured instead "
        "(the app's server: {extra_args: [...]} Triton flags)"
    )


def shm_region_not_found(kind: str, name: str) -> tuple[str, str]:
    """Triton's status (code name, message) for a region a caller never registered."""
    return "NOT_FOUND", f"Unable to find {kind} shared memory region: '{name}'"


# -- the routes ---------------------------------------------------------------------------------

_NAME = r"([^/]+)"
_VERSION = r"(?:/versions/([^/]+))?"
_INFER = re.compile(rf"^/v2/models/{_NAME}{_VERSION}/infer$")

Handler = Callable[..., Awaitable[HttpAnswer]]


@dataclass(frozen=True)
class _Request:
    node: RouteNode
    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    body: bytes | None
    groups: tuple[str | None, ...]


def infer_route(method: str, path: str) -> str | None:
    """The model of a slot-inference request (``POST /v2/models/<m>/infer``, no version), else ``None``."""
    if method != "POST":
        return None
    match = _INFER.match(path)
    if match is None or match.group(2) is not None:
        return None
    return match.group(1)


async def http_route(
    node: RouteNode,
    method: str,
    path: str,
    query: str = "",
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
) -> HttpAnswer:
    """The answer to one KServe v2 / Triton HTTP request other than slot inference.

    Args:
        node: The replica's node.
        method: The HTTP method.
        path: The path below the app's route prefix, decoded (``/v2/...``).
        query: The raw query string (passed on to Triton).
        headers: The request headers (any case).
        body: The whole request body (``None`` or empty when there is none).

    Returns:
        The answer; every failure is an answer too (``{"error": ...}``), never an exception.
    """
    lowered = {k.lower(): v for k, v in (headers or {}).items()}
    for pattern, methods in _ROUTES:
        match = pattern.match(path)
        if match is None:
            continue
        handler = methods.get(method)
        if handler is None:
            return error_answer(405, "Method Not Allowed")
        request = _Request(node, method, path, query, lowered, body, match.groups())
        try:
            return await handler(request)
        except RayTritonShmError as e:
            return error_answer(kserve_errors.http_status(e), kserve_errors.error_message(e))
    return error_answer(404, "Not Found")


def error_answer(status: int, message: str) -> HttpAnswer:
    """Triton's error answer: ``{"error": message}`` (segment keys redacted)."""
    return HttpAnswer(status, kserve_errors.error_body(redact(message)))


async def _server_metadata(request: _Request) -> HttpAnswer:
    body = {
        "name": SERVER_NAME,
        "version": request.node.info.version,
        "extensions": extensions(request.node.explicit_model_control),
    }
    return HttpAnswer(200, json.dumps(body, separators=(",", ":")).encode())


async def _forward(request: _Request) -> HttpAnswer:
    return await forward(
        request.node, request.method, request.path, request.query, request.headers, request.body
    )


async def _probe(request: _Request) -> HttpAnswer:
    return await forward(
        request.node, request.method, request.path, request.query, request.headers, None, probe=True
    )


async def _versioned_infer(request: _Request) -> HttpAnswer:
    body = request.body or b""
    header_length = kserve.parse_header_length(request.headers.get(kserve.HEADER_LENGTH))
    kserve.refuse_shm_parameters(_inflate(request, body), header_length)
    return await _forward(request)


async def _settings(request: _Request, what: str) -> HttpAnswer:
    """Log or trace settings: read from the node's Triton; a change refused."""
    if request.method == "POST" and request.body:
        try:
            settings = json.loads(_inflate(request, request.body))
        except (InputError, ValueError, UnicodeDecodeError):
            settings = None  # not JSON: Triton's own answer says so
        if settings != {} and settings is not None:
            raise settings_refused(what)
    return await _forward(request)


async def _log_settings(request: _Request) -> HttpAnswer:
    return await _settings(request, "log")


async def _trace_settings(request: _Request) -> HttpAnswer:
    return await _settings(request, "trace")


async def _repository_control(request: _Request) -> HttpAnswer:
    model, action = request.groups[0] or "", request.groups[1] or ""
    if not request.node.explicit_model_control:
        raise model_control_refused(action, model)
    if action == "load" and _sends_files(request):
        raise model_files_refused(model)
    timeout = CONTROL_TIMEOUT_S
    answer = await forward(
        request.node, "POST", request.path, request.query, request.headers, request.body, timeout=timeout
    )
    if answer.status == 200:
        try:
            await request.node.model_changed(model)
        except Exception:  # Triton did it; the node catches up when a client finds the layout changed
            logger.warning("the node could not re-read the configuration of %s", model, exc_info=True)
    return answer


def _sends_files(request: _Request) -> bool:
    """Whether a load request's JSON parameters name model files (unparsable bodies are Triton's)."""
    try:
        body = json.loads(_inflate(request, request.body or b"") or b"{}")
    except (InputError, ValueError, UnicodeDecodeError):
        return False
    parameters = body.get("parameters") if isinstance(body, dict) else None
    return isinstance(parameters, dict) and any(
        isinstance(key, str) and key.startswith(FILE_PARAMETER_PREFIX) for key in parameters
    )


def _shm(kind: str) -> dict[str, Handler]:
    """The handlers of one shared-memory kind's routes (``groups``: region name, operation)."""

    async def status(request: _Request) -> HttpAnswer:
        region = request.groups[0]
        if region is None:
            return HttpAnswer(200, b"[]")
        _, message = shm_region_not_found(kind, region)
        return error_answer(404, message)

    async def unregister(request: _Request) -> HttpAnswer:
        return HttpAnswer(200, b"")

    async def register(request: _Request) -> HttpAnswer:
        raise shm_registration_refused(kind)

    return {"status": status, "unregister": unregister, "register": register}


_SHM = {"systemsharedmemory": _shm("system"), "cudasharedmemory": _shm("cuda")}


async def _shm_route(request: _Request) -> HttpAnswer:
    kind, region, operation = request.groups
    return await _SHM[kind or ""][operation or ""](_replace_groups(request, (region, operation)))


def _replace_groups(request: _Request, groups: tuple[str | None, ...]) -> _Request:
    return _Request(
        request.node, request.method, request.path, request.query, request.headers, request.body, groups
    )


_GET = "GET"
_POST = "POST"
_SHM_KIND = r"(systemsharedmemory|cudasharedmemory)"
_REGION = r"(?:/region/([^/]+))?"
_ROUTES: list[tuple[re.Pattern[str], dict[str, Handler]]] = [
    (re.compile(r"^/v2$"), {_GET: _server_metadata}),
    (re.compile(r"^/v2/health/(?:live|ready)$"), {_GET: _probe}),
    (re.compile(r"^/v2/models/stats$"), {_GET: _forward}),
    (re.compile(rf"^/v2/models/{_NAME}{_VERSION}/stats$"), {_GET: _forward}),
    (re.compile(rf"^/v2/models/{_NAME}{_VERSION}$"), {_GET: _forward}),
    (re.compile(rf"^/v2/models/{_NAME}{_VERSION}/ready$"), {_GET: _probe}),
    (re.compile(rf"^/v2/models/{_NAME}{_VERSION}/config$"), {_GET: _forward}),
    (re.compile(rf"^/v2/models/{_NAME}{_VERSION}/infer$"), {_POST: _versioned_infer}),
    (re.compile(rf"^/v2/models/{_NAME}{_VERSION}/generate(?:_stream)?$"), {_POST: _forward}),
    (re.compile(rf"^/v2/models/{_NAME}/trace/setting$"), {_GET: _trace_settings, _POST: _trace_settings}),
    (re.compile(r"^/v2/trace/setting$"), {_GET: _trace_settings, _POST: _trace_settings}),
    (re.compile(r"^/v2/logging$"), {_GET: _log_settings, _POST: _log_settings}),
    (re.compile(r"^/v2/repository/index$"), {_POST: _forward}),
    (re.compile(rf"^/v2/repository/models/{_NAME}/(load|unload)$"), {_POST: _repository_control}),
    (re.compile(rf"^/v2/{_SHM_KIND}{_REGION}/(status)$"), {_GET: _shm_route}),
    (re.compile(rf"^/v2/{_SHM_KIND}{_REGION}/(unregister|register)$"), {_POST: _shm_route}),
]


# -- the node's Triton over loopback HTTP --------------------------------------------------------

_FORWARDED_HEADERS = ("content-type", "content-encoding", "accept-encoding", kserve.HEADER_LENGTH)
_ANSWER_HEADERS = ("content-type", "content-encoding", kserve.HEADER_LENGTH)


async def forward(
    node: RouteNode,
    method: str,
    path: str,
    query: str,
    headers: Mapping[str, str],
    body: bytes | None,
    *,
    probe: bool = False,
    timeout: float | None = None,
) -> HttpAnswer:
    """The request sent to the node's Triton over loopback HTTP, and its answer as it is.

    Health and readiness (``probe``) answer 400, KServe's "false", when Triton
    does not answer within :data:`PROBE_TIMEOUT_S`; other routes 503.
    """
    sent = {k: v for k, v in headers.items() if k.lower() in _FORWARDED_HEADERS}
    target = kserve.triton_path(path, query)
    limit = timeout if timeout is not None else PROBE_TIMEOUT_S if probe else PROXY_TIMEOUT_S
    try:
        code, answer, answer_headers = await asyncio.to_thread(
            triton_http, node.info.http_url, method, target, body or None, sent, limit
        )
    except OSError as e:
        return error_answer(400 if probe else 503, f"Triton on this node did not answer: {type(e).__name__}")
    if code >= 400:  # Triton's messages can name shm keys; they must not leave the machine
        answer = redact_bytes(answer)
    return HttpAnswer(code, answer, answer_headers)


def triton_http(
    url: str, method: str, path: str, body: bytes | None, headers: Mapping[str, str], timeout: float
) -> tuple[int, bytes, dict[str, str]]:
    """One request to Triton's HTTP endpoint at ``host:port``: its status, body and protocol headers.

    Raises:
        OSError: Triton cannot be reached or did not answer in time.
    """
    host, _, port = url.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers))
        answer = conn.getresponse()
        data = answer.read()
        kept = {k.lower(): v for k, v in answer.getheaders() if k.lower() in _ANSWER_HEADERS}
        return answer.status, data, kept
    except http.client.HTTPException as e:
        raise OSError(f"unreadable answer from Triton: {e}") from e
    finally:
        conn.close()


def redact_bytes(data: bytes) -> bytes:
    """``data`` with segment keys redacted when it is text (Triton's error messages can name them)."""
    if b"rtshm_" not in data:
        return data
    try:
        return redact(data.decode()).encode()
    except UnicodeDecodeError:
        return data


def _inflate(request: _Request, body: bytes) -> bytes:
    """``body`` decompressed by the request's ``Content-Encoding``, never past the node's body limit.

    Raises:
        InputError: An unsupported encoding, or data that does not inflate.
        RequestTooLargeError: It inflates to more than the limit.
    """
    name = (request.headers.get("content-encoding") or "identity").strip().lower()
    if name == "identity":
        return body
    return bounded.inflate(body, name, request.node.max_request_bytes)
