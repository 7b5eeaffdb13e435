"""The OpenAI-compatible HTTP server on an `Engine`: `create_app(engine, model_name=...)` is a FastAPI app.

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events or whole), GET
/v1/models, GET /health, GET /metrics (Prometheus text), POST /tokenize and /detokenize, GET /tokenizer_info, and
(with allow_runtime_lora_updating, vLLM's opt-in) POST /v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's,
their lora_path confined to `lora_dir` when one is given. A request whose `model`
names a loaded LoRA adapter is served with it, as vLLM serves it; /v1/models lists the adapters, each with its
base as `parent`.
The app knows the engine's Python API only (`submit`, handles, `stats`, `on_finish`, `compiles_after_warmup`).

Errors (`linnet_jax.serve.errors`) are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`: 400
naming the field for a body that is not JSON, a wrong type, a bad value, a field this server does not implement,
a prompt that leaves no room for a token (a larger max_tokens is clamped to the room, finishing with "length"),
a JSON schema, regex or grammar that does not compile, is over a bound or can never be completed (naming
response_format or structured_outputs; one found dead mid-output ends its request with that 400);
401 without the API key; 404 for an unknown model (an adapter's name included); 413 for a body over
`max_request_bytes`; 429 with Retry-After
when the engine's queue is full; 503 (and /health 503) while shutting down or once the engine has failed; 500
for the requests the engine was serving when it failed (streamed: a last `data: {"error": ...}` event), and for
one request that failed alone (the server serves on). A client
that disconnects has its requests cancelled: their slots are free before the engine's next decode dispatch.
Tokenizing and every other cost that grows with a request runs off the event loop. The Prometheus metrics are
`linnet_jax.serve.metrics`.
"""

import asyncio
import itertools
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from linnet_jax._version import __version__
from linnet_jax.serve.echo import echoes, prompt_ids, stop_ids
from linnet_jax.serve.engine import Engine, EngineFailed, Handle, Piece, QueueFull
from linnet_jax.serve.errors import (BAD_INPUT, MAX_REQUEST_BYTES, APIError, ASCIIJSONResponse, BearerAuth, BodyLimit,
                                     check_api_key, error_body, error_response, request_error, validation_error)
from linnet_jax.serve.metrics import Metrics
from linnet_jax.inputs import RequestError
from linnet_jax.serve.protocol import (ChatCompletions, ChatRequest, CompletionRequest, Completions, DetokenizeRequest,
                                       LoadLoraRequest, Output, Sampling, Shape, TokenizeRequest, UnloadLoraRequest,
                                       budget, engine_options, finish_reason, message_dicts, refused_field, structured,
                                       usage)
from linnet_jax.tokenizer import TOKENIZER_CLASS

log = logging.getLogger("linnet_jax.serve")
RETRY_AFTER_S = 1
FLUSH_S = 5  # seconds the last responses get to be sent once the engine has drained


def completion_prompts(prompt) -> list[dict]:
    """/v1/completions' prompt as Engine.submit keywords, one per prompt (text is encoded without the chat
    template)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt, "chat": False}]
    if not prompt:
        raise APIError(400, "prompt is an empty list", "prompt")
    if isinstance(prompt[0], int):
        return [{"tokens": prompt}]
    if isinstance(prompt[0], str):
        return [{"prompt": text, "chat": False} for text in prompt]
    if (empty := next((i for i, ids in enumerate(prompt) if not ids), None)) is not None:
        raise APIError(400, f"prompt[{empty}] is an empty list of ids; expected at least one id", "prompt")
    return [{"tokens": ids} for ids in prompt]


def submit_all(engine: Engine, prompts: list[dict], n: int, options: dict, prompt_field: str,
               renamed: dict[str, str]) -> list[Handle]:
    """Submit each prompt n times (choice i of one seed), prompt-major; all of them or none (cancelled). A refusal
    names the body's field (`renamed`: the body's names of Engine.submit's keywords)."""
    handles: list[Handle] = []
    try:
        for prompt in prompts:
            handles += [engine.submit(**prompt, **options, choice=choice) for choice in range(n)]
    except BaseException as error:
        for handle in handles:
            handle.cancel()
        raise submit_error(error, prompt_field, renamed) from error
    return handles


def submit_error(error: BaseException, prompt_field: str, renamed: dict[str, str]) -> BaseException:
    """What Engine.submit raised, as an APIError where the client is the cause."""
    if isinstance(error, QueueFull):
        return APIError(429, str(error), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, RequestError) and error.field == "lora":  # unloaded since the request was checked
        return APIError(404, str(error), "model", "model_not_found")
    if isinstance(error, BAD_INPUT):
        return request_error(error, prompt_field, renamed)
    if isinstance(error, EngineFailed):
        return engine_failed(error.__cause__, 503)
    if isinstance(error, RuntimeError):
        return APIError(503, str(error), code="shutting_down")
    return error


def engine_failed(failure: Exception, status: int) -> APIError:
    """An answer naming the engine's failure: 500 for the requests it was serving, 503 for later ones."""
    return APIError(status, f"the engine failed ({type(failure).__name__}: {failure}); the server is exiting",
                    code="engine_failed")


def adapter_root(lora_dir: str | Path) -> Path:
    """lora_dir resolved; a ValueError unless it is a directory."""
    root = Path(lora_dir).resolve()
    if not root.is_dir():
        raise ValueError(f"lora_dir {str(lora_dir)!r} is not a directory")
    return root


def adapter_path(lora_path: str, root: Path | None) -> Path:
    """Where a load request's lora_path leads: resolved (symlinks and `..` followed), relative to `root` when
    there is one, and then a 400 naming lora_path unless it stays under root (the same answer whether or not
    the path exists)."""
    try:
        path = Path(lora_path).resolve() if root is None else (root / lora_path).resolve()
    except (ValueError, OSError) as error:  # a NUL byte, a loop of links
        raise APIError(400, f"lora_path {lora_path!r} is not a path the server can read", "lora_path") from error
    if root is not None and not path.is_relative_to(root):
        raise APIError(400, f"lora_path {lora_path!r} is not an adapter directory under the server's --lora-dir "
                            f"(give a path relative to it)", "lora_path")
    return path


def body_names(body: Sampling) -> dict[str, str]:
    """The body's names of Engine.submit's arguments where they differ: its grammar's field."""
    return {"structured": structured(body)[1]}


def failed(handle: Handle, renamed: dict[str, str]) -> APIError | None:
    """Why the handle's request ended with an error, else None: a 500 naming the engine's failure; a 400 naming the
    field (by the body's name for it in `renamed`) that failed it alone (a grammar that can never be completed);
    a 500 for anything else that failed it alone, the server serving on."""
    failure = handle.failure
    if handle.generation.stop_reason != "error":
        return None
    if failure is handle.engine.failure:
        return engine_failed(failure, 500)
    if isinstance(failure, RequestError):
        return request_error(failure, "prompt", renamed)
    return APIError(500, f"the request failed ({type(failure).__name__}: {failure}); the server serves on",
                    code="request_failed")


async def collect(handle: Handle) -> Output:
    output = Output()
    async for piece in handle:
        output.add(piece)
    return output


async def merged(handles: list[Handle]) -> AsyncIterator[tuple[int, Piece | None]]:
    """(index, piece) as the handles' pieces arrive, and (index, None) when handle `index` finishes."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: Handle) -> None:
        async for piece in handle:
            await queue.put((index, piece))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(index, handle)) for index, handle in enumerate(handles)]
    running = len(handles)
    try:
        while running:
            item = await queue.get()
            running -= item[1] is None
            yield item
    finally:
        for task in tasks:
            task.cancel()


def cancel_on_disconnect(request: Request, handles: list[Handle]) -> asyncio.Task:
    """A task that cancels the handles when the client disconnects."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel(handles)

    return asyncio.ensure_future(watch())


def cancel(handles: list[Handle]) -> None:
    for handle in handles:
        if not handle.done:
            handle.cancel()


async def stream_chunks(shape: Shape, handles: list[Handle], n: int, include_usage: bool, renamed: dict[str, str]
                        ) -> AsyncIterator[dict]:
    """The chunks of a streamed response: each piece of each choice, its finish, then (asked for) usage; an error
    body, last, when a request failed (`failed`)."""
    started, offsets = [False] * len(handles), [0] * len(handles)
    async for index, piece in merged(handles):
        if piece is None and (error := failed(handles[index], renamed)):
            yield error_body(error)
            return
        if piece is None:
            yield shape.chunk([shape.end(index, finish_reason(handles[index]), not started[index])])
        else:
            yield shape.chunk([shape.delta(index, piece, not started[index], offsets[index])])
            started[index], offsets[index] = True, offsets[index] + len(piece.text)
    if include_usage:
        yield shape.chunk([], usage(handles, n))


async def server_sent_events(chunks: AsyncIterator[dict], watcher: asyncio.Task, handles: list[Handle]):
    """`data: {json}` per chunk, then `data: [DONE]` (not after an error); the handles are cancelled if the stream
    stops early."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
            if "error" in chunk:
                return
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        cancel(handles)


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES, allow_runtime_lora_updating: bool = False,
               lora_dir: str | Path | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`, serving it as `model_name`; with `api_key` (non-empty), every
    endpoint but /health needs `Authorization: Bearer api_key`; a body over `max_request_bytes` is a 413.
    allow_runtime_lora_updating: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (else they are 404, as
    absent); lora_dir: the directory whose adapters they may load (None: any path the server can read)."""
    check_api_key(api_key)
    root = None if lora_dir is None else adapter_root(lora_dir)
    app = FastAPI(title="linnet_jax", version=__version__, default_response_class=ASCIIJSONResponse)
    metrics, created, tokenizer = Metrics(engine), int(time.time()), engine.model.tokenizer
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    def check_model(name: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model); a 404 naming `model` for another name."""
        if name is None or name == model_name:
            return None
        if name in engine.loras:
            return name
        served = [model_name, *engine.loras]
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served}", "model",
                       "model_not_found")

    def check_available() -> None:
        """A 503 once the engine admits nothing: it is shutting down, or it failed."""
        if engine.failure is not None:
            raise engine_failed(engine.failure, 503)
        if engine.closing:
            raise APIError(503, "the server is shutting down: it admits no new requests", code="shutting_down")

    async def admit(body: Sampling, prompts: list[dict], top_logprobs: int, prompt_field: str) -> list[Handle]:
        """The request checked and submitted (prompts encoded off the event loop): n handles per prompt,
        prompt-major."""
        check_request(body)
        n = body.n or 1
        if n * len(prompts) > engine.slots:
            raise APIError(400, f"n={n} choices of {len(prompts)} prompt(s) need more than the server's "
                                f"{engine.slots} slots", "n")
        seed = secrets.randbits(63) if body.seed is None else body.seed
        spec, field = structured(body)
        options = engine_options(body, top_logprobs) | {"seed": seed, "lora": check_model(body.model),
                                                        "structured": spec}
        return await asyncio.to_thread(submit_all, engine, prompts, n, options, prompt_field, {"structured": field})

    def check_request(body: Sampling) -> None:
        check_model(body.model)
        check_available()
        if refused := refused_field(body):
            raise APIError(400, f"{refused} is not supported by this server", refused, "unsupported_field")

    def served_name(body: Sampling) -> str:
        """The name a response gives: the adapter's the request named, else the base model's."""
        return body.model if check_model(body.model) else model_name

    async def collected(request: Request, handles: list[Handle], renamed: dict[str, str]) -> list[Output]:
        """Each handle's whole output; all of them cancelled if the client disconnects first; the error of the
        first that failed (`failed`)."""
        watcher = cancel_on_disconnect(request, handles)
        try:
            outputs = await asyncio.gather(*(collect(handle) for handle in handles))
        finally:
            watcher.cancel()
            cancel(handles)
        if error := next(filter(None, (failed(handle, renamed) for handle in handles)), None):
            raise error
        return outputs

    async def respond(request: Request, body: Sampling, shape: Shape, prompts: list[dict], top_logprobs: int,
                      prompt_field: str):
        handles = await admit(body, prompts, top_logprobs, prompt_field)
        n, renamed = body.n or 1, body_names(body)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = server_sent_events(stream_chunks(shape, handles, n, include_usage, renamed),
                                        cancel_on_disconnect(request, handles), handles)
            return StreamingResponse(events, media_type="text/event-stream")
        outputs = await collected(request, handles, renamed)
        choices = [shape.choice(i, output, finish_reason(handle))
                   for i, (output, handle) in enumerate(zip(outputs, handles))]
        return shape.response(choices, usage(handles, n))

    async def echoed(request: Request, body: CompletionRequest, shape: Completions, prompts: list[dict], top: int):
        """/v1/completions with echo (`linnet_jax.serve.echo`): max_tokens 0 scores the prompts only."""
        if body.stream:
            raise APIError(400, "echo is not supported with stream: true", "echo")
        if check_model(body.model):
            raise APIError(400, "echo is not supported with a LoRA adapter (it scores the prompt with the base model)",
                           "echo")
        check_request(body)
        ids = await asyncio.to_thread(prompt_ids, engine.model, prompts, engine.max_len)
        n = body.n or 1
        if budget(body)[1] == 0:
            outputs, reasons = [Output() for _ in range(n * len(ids))], ["length"] * (n * len(ids))
            stopped = [set() for _ in outputs]
            tokens = sum(len(row) for row in ids)
            counts = {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
        else:
            handles = await admit(body, [{"tokens": row} for row in ids], top, "prompt")
            outputs = await collected(request, handles, body_names(body))
            reasons, counts = [finish_reason(handle) for handle in handles], usage(handles, n)
            stopped = [stop_ids(engine.model, body, handle.generation.stop_reason) for handle in handles]
        parts = await asyncio.to_thread(echoes, engine.model, prompts, ids, outputs, stopped, top,
                                        body.logprobs is not None)
        choices = [shape.echoed(shape.choice(i, output, reason), *parts[i])
                   for i, (output, reason) in enumerate(zip(outputs, reasons))]
        return shape.response(choices, counts)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        shape = Completions(served_name(body), tokenizer, body.logprobs is not None)
        prompts, top = completion_prompts(body.prompt), body.logprobs or 0
        if body.echo:
            return await echoed(request, body, shape, prompts, top)
        if budget(body)[1] == 0:
            raise APIError(400, "max_tokens must be at least 1 (0 scores the prompt, with echo: true)", "max_tokens")
        return await respond(request, body, shape, prompts, top, "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        shape = ChatCompletions(served_name(body), tokenizer, bool(body.logprobs))
        top = (body.top_logprobs or 0) if body.logprobs else 0
        return await respond(request, body, shape, [{"prompt": message_dicts(body.messages)}], top, "messages")

    @app.get("/v1/models")
    async def models():
        def card(name: str, root: str | None, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": created, "owned_by": "linnet_jax", "root": root,
                    "parent": parent, "max_model_len": engine.max_len}

        return {"object": "list", "data": [card(model_name, model_name, None),
                                           *(card(name, root, model_name) for name, root in engine.loras.items())]}

    async def load_lora_adapter(body: LoadLoraRequest):
        """vLLM's: serve the PEFT adapter at lora_path (under lora_dir) as lora_name from now on (compiles
        nothing). Its errors name lora_path as the body gave it, never the path it resolved to."""
        if body.lora_name == model_name:
            raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
        path = adapter_path(body.lora_path, root)
        try:
            await asyncio.to_thread(engine.load_lora, body.lora_name, path)
        except BAD_INPUT as error:
            answer = request_error(error, "lora_path")
            answer.message = answer.message.replace(str(path), body.lora_path)
            raise answer from error
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(body: UnloadLoraRequest):
        """vLLM's: serve lora_name no more (requests already using it finish with it)."""
        try:
            engine.unload_lora(body.lora_name)
        except BAD_INPUT as error:
            raise request_error(error, "lora_name") from error
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    if allow_runtime_lora_updating:
        app.post("/v1/load_lora_adapter")(load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(unload_lora_adapter)

    @app.get("/health")
    async def health():
        check_available()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def needs_tokenizer():
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids instead of text")
        return tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        field = "prompt" if body.messages is None else "messages"
        messages = None if body.messages is None else message_dicts(body.messages)
        try:
            ids = await asyncio.to_thread(tokenize_ids, needs_tokenizer(), body, messages)
        except BAD_INPUT as error:
            raise request_error(error, field) from error
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        served = needs_tokenizer()
        return {"tokenizer_class": TOKENIZER_CLASS, "bos_token": served.bos_token, "eos_token": served.eos_token,
                "pad_token": served.pad_token, "chat_template": served.chat_template,
                "model_max_length": engine.max_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        try:
            return {"prompt": await asyncio.to_thread(needs_tokenizer().decode, body.tokens)}
        except BAD_INPUT as error:
            raise request_error(error, "tokens") from error

    return app


def tokenize_ids(tokenizer, body: TokenizeRequest, messages: list[dict] | None) -> list[int]:
    """/tokenize's ids: the prompt encoded, or the messages through the chat template."""
    if messages is None:
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=body.add_generation_prompt)


def serve(app: FastAPI, engine: Engine, *, host: str, port: int, deadline: float) -> None:
    """Serve `app` with uvicorn until SIGTERM or SIGINT, or until the engine fails (then raise EngineFailed).

    The first signal drains: the engine admits nothing more (new requests and /health get 503), running requests
    get `deadline` seconds, what is left is cancelled, then the server stops. A second signal cuts the drain short
    (cancels now); a third stops the server at once. The signal handler only counts signals and sets flags, so
    signals in quick succession cannot interleave into a broken state; it returns without re-raising them."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            received = next(signals)  # one C call: a signal that interrupts this handler gets the next number
            if received == 0:
                drainer.start()
            elif received == 1:
                engine.hurry()
            else:
                self.force_exit = self.should_exit = True

    def drain() -> None:
        engine.close(deadline)
        server.should_exit = True

    signals = itertools.count()
    config = uvicorn.Config(app, host=host, port=port, lifespan="off", timeout_graceful_shutdown=FLUSH_S)
    server = DrainingServer(config)
    drainer = threading.Thread(target=drain, name="linnet-jax-drain", daemon=True)
    engine.on_failure.append(lambda error: setattr(server, "should_exit", True))
    server.run()
    if drainer.ident is not None:  # a signal started the drain
        drainer.join()
    else:
        engine.close()
    engine.check_alive()
