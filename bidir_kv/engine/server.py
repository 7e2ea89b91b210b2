"""HTTP routes of the emulated engine (aiohttp): OpenAI API, /tokenize, /metrics, admin.

``kv_transfer_params`` placement follows vLLM 0.33: top level of the non-streaming
body, top level of the terminal SSE chunk (chat chunks carry ``null`` otherwise).
With ``--emulate-vllm 0.32`` streams carry no params at all (docs/protocol.md §14).
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

from aiohttp import web

from bidir_kv.engine.api import (
    ApiError,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    error_body,
    logprob_entries,
    now_s,
    parse_request,
    render_prompt,
    salt_root,
    usage,
)
from bidir_kv.engine.faults import FaultError, Faults
from bidir_kv.engine.hf_tokenizer import HFTokenizer
from bidir_kv.engine.jsonenc import dumps, json_response
from bidir_kv.engine.model import ChatTemplateError, Tokenizer
from bidir_kv.engine.sampling import TextState, Vocab
from bidir_kv.engine.scheduler import EngineCore, Request, RequestError
from bidir_kv.errors import BidirKVError
from bidir_kv.intake import InputError, decode_json, read_capped

__all__ = ["Routes", "build_app", "error_response_for"]

logger = logging.getLogger("bidir_kv.engine")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _json_error(status: int, message: str, kind: str) -> web.Response:
    return json_response(error_body(status, message, kind), status=status)


def error_response_for(exc: BidirKVError) -> web.Response:
    """The engine's one translation of our errors into HTTP answers (docs/architecture.md,
    Errors): the status and type the error carries, and its message, except that a 500
    says no more than vLLM's "Internal server error"."""
    message = "Internal server error" if exc.http_status == 500 else str(exc)
    return _json_error(exc.http_status, message, exc.error_type)


class Routes:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: Tokenizer | HFTokenizer,
        served_names: list[str],
        model: str,
        faults: Faults,
    ) -> None:
        self.core = core
        self._max_body = core.settings.max_body_bytes
        self.tok = tokenizer
        self.names = served_names
        self.model = model
        self.faults = faults
        self.vocab = Vocab.of(tokenizer)
        self.ready = False  # /health answers 503 until the transport and scheduler run

    # ---- plain endpoints -------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503, text="starting")
        stalled = self.core.stall_reason()
        if stalled is not None:
            return web.Response(status=503, text=stalled)
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        from bidir_kv import __version__

        emulated = "0.32.0" if self.core.settings.emulate_vllm == "0.32" else "0.33.0"
        return json_response({"version": emulated, "bidir_kv": __version__})

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": now_s(),
                "owned_by": "vllm",
                "root": self.model,
                "parent": None,
                "max_model_len": self.core.settings.max_model_len,
            }
            for name in self.names
        ]
        return json_response({"object": "list", "data": data})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.core.metrics.render()
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            if "messages" in body:
                text = render_prompt(
                    self.tok,
                    body["messages"],
                    body.get("add_generation_prompt") is not False,
                    body.get("chat_template_kwargs") or {},
                )
                tokens = self.tok.encode(text, body.get("add_special_tokens") is True)
            elif isinstance(body.get("prompt"), str):
                special = body.get("add_special_tokens") is not False
                tokens = self.tok.encode(body["prompt"], special)
            else:
                return _json_error(
                    400, "/tokenize needs 'prompt' (string) or 'messages'", "BadRequestError"
                )
        except ChatTemplateError as exc:
            return error_response_for(exc)
        strs = self.tok.token_strs(tokens) if body.get("return_token_strs") is True else None
        body = {
            "count": len(tokens),
            "max_model_len": self.core.settings.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
        return json_response(body)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            ids = self.tok.check_ids(body.get("tokens") or [])
        except ValueError as exc:
            return _json_error(400, str(exc), "BadRequestError")
        return json_response({"prompt": self.tok.decode(ids)})

    def _logprobs(
        self, pr: ParsedRequest, ids: list[int], start: int, offset: int
    ) -> dict[str, Any] | None:
        if pr.logprobs is None:
            return None
        entries = logprob_entries(self.tok, ids, start, pr.logprobs)
        return chat_logprobs(entries) if pr.chat else completion_logprobs(entries, offset)

    # ---- admin -----------------------------------------------------------------------

    def _admin_refusal(self, request: web.Request) -> web.Response | None:
        """None when the caller may use an admin endpoint, else its 403 (or 401)."""
        settings = self.core.settings
        if settings.admin:
            return None
        if settings.admin_token:
            sent = request.headers.get("Authorization", "")
            if hmac.compare_digest(sent.encode(), f"Bearer {settings.admin_token}".encode()):
                return None
            return _json_error(
                401,
                f"{request.path} needs 'Authorization: Bearer <token>' "
                "(the engine's --admin-token)",
                "AuthenticationError",
            )
        return _json_error(
            403,
            f"{request.path} is an admin endpoint, off on this engine: "
            "start it with --enable-admin or --admin-token",
            "PermissionDenied",
        )

    async def faults_get(self, request: web.Request) -> web.Response:
        if (refused := self._admin_refusal(request)) is not None:
            return refused
        return json_response(self.faults.to_dict())

    async def faults_post(self, request: web.Request) -> web.Response:
        if (refused := self._admin_refusal(request)) is not None:
            return refused
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            self.faults.update(body)
        except FaultError as exc:
            return error_response_for(exc)
        logger.info("faults set: %s", self.faults.to_dict())
        return json_response(self.faults.to_dict())

    async def claim(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        refusal_400 = _claim_body_error(body)
        if refusal_400 is not None:
            return _json_error(400, refusal_400, "BadRequestError")
        rid, blocks = body["request_id"], body["blocks"]
        reader = body.get("reader")
        # what the handle holds as granted (a fault may release it during the claim; the
        # reader's fence check then catches the reuse, docs/connector.md §5)
        held = self.core.handle_tokens(rid)
        refusal = self.core.claim(rid, blocks, reader if isinstance(reader, str) else None)
        if refusal is not None:
            return json_response({"ok": False, "error": refusal}, status=410)
        return json_response({"ok": True, "tokens": None if held is None else held.to_wire()})

    async def drop_peer(self, request: web.Request) -> web.Response:
        """``POST /drop_peer {"engine_id": ...}`` (vLLM PR #56341), sent by a router
        whose health probe saw a paired engine die or restart (docs/engine.md)."""
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        engine_id = body.get("engine_id") if isinstance(body, dict) else None
        if not isinstance(engine_id, str) or not engine_id:
            return _json_error(400, "'engine_id' must be a non-empty string", "BadRequestError")
        dropped = self.core.drop_peer(engine_id)
        self.core.metrics.inc(self.core.metrics.peers_dropped)
        logger.info("drop_peer %s: %s", engine_id, dropped)
        return json_response({"engine_id": engine_id, **dropped})

    async def state(self, request: web.Request) -> web.Response:
        if (refused := self._admin_refusal(request)) is not None:
            return refused
        return json_response(self.core.assert_idle())

    # ---- completions -----------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        try:
            return decode_json(await read_capped(request, self._max_body, "--max-body-bytes"))
        except InputError as exc:
            return error_response_for(exc)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            pr = parse_request(body, chat=chat, tokenizer=self.tok, served_names=self.names)
        except ApiError as exc:
            return error_response_for(exc)
        if (
            pr.params is not None
            and pr.params.do_remote_prefill
            and (self.core.settings.kv.kv_role == "kv_producer")
        ):
            return _json_error(
                400,
                "kv_transfer_params.do_remote_prefill: this is a prefill "
                "node (kv_role kv_producer); it does not pull a remote "
                "prefill",
                "BadRequestError",
            )
        base = request.headers.get("X-Request-Id")
        prefix = "chatcmpl" if chat else "cmpl"
        rid = self.core.new_request_id(prefix, base)
        public_id = f"{prefix}-{base}" if base else rid
        max_tokens = pr.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.core.settings.max_model_len - len(pr.prompt))
        req = Request(
            request_id=rid,
            prompt=pr.prompt,
            max_tokens=max_tokens,
            ignore_eos=pr.ignore_eos,
            stop_token_ids=pr.stop_token_ids,
            params=pr.params,
            min_tokens=pr.min_tokens,
            include_stop_str=pr.include_stop_str,
            chain_root=salt_root(pr.cache_salt),
            vocab=self.vocab,
            text=TextState(
                self.tok.decode,
                stops=pr.stop,
                include_stop=pr.include_stop_str,
                skip_special_tokens=pr.skip_special_tokens,
                context=pr.prompt,
            ),
        )
        try:
            self.core.submit(req)
        except RequestError as exc:
            return error_response_for(exc)
        if pr.stream:
            return await self._stream(request, req, pr, public_id)
        await req.done.wait()
        if req.error is not None:
            return error_response_for(req.error)
        return json_response(self._final_body(req, pr, public_id))

    def _final_body(self, req: Request, pr: ParsedRequest, public_id: str) -> dict[str, Any]:
        text = req.text.final
        choice: dict[str, Any] = {"index": 0}
        if pr.chat:
            choice["message"] = {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": [],
            }
        else:
            choice["text"] = text
        choice.update(
            logprobs=self._logprobs(pr, req.output, 0, 0),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        if pr.return_token_ids:
            choice["token_ids"] = list(req.output)
            if not pr.chat:
                choice["prompt_token_ids"] = list(req.prompt)
        out: dict[str, Any] = {
            "id": public_id,
            "object": "chat.completion" if pr.chat else "text_completion",
            "created": now_s(),
            "model": pr.model,
            "choices": [choice],
            "usage": usage(req.prompt_len, len(req.output), self.core.usage_cached_tokens(req)),
        }
        if pr.chat and pr.return_token_ids:
            out["prompt_token_ids"] = list(req.prompt)
        out["kv_transfer_params"] = None if req.out_params is None else req.out_params.to_dict()
        return out

    async def _stream(
        self, request: web.Request, req: Request, pr: ParsedRequest, public_id: str
    ) -> web.StreamResponse:
        first = await req.events.get()
        if first is None and req.error is not None:
            return error_response_for(req.error)
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        streamed = 0
        offset = 0
        v032 = self.core.settings.emulate_vllm == "0.32"
        created = now_s()
        obj = "chat.completion.chunk" if pr.chat else "text_completion"

        def chunk(
            choices: list[dict[str, Any]], params: Any = None, terminal: bool = False
        ) -> bytes:
            c: dict[str, Any] = {
                "id": public_id,
                "object": obj,
                "created": created,
                "model": pr.model,
                "choices": choices,
            }
            if not v032 and (pr.chat or terminal):
                c["kv_transfer_params"] = params
            return _sse(c)

        try:
            await resp.prepare(request)
            if pr.chat:
                head: dict[str, Any] = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                await resp.write(chunk([head]))
            tok: int | None = first
            while tok is not None:
                nxt = await req.events.get()
                terminal = nxt is None
                piece = req.text.pieces[streamed] + (req.text.tail if terminal else "")
                ch = _token_choice(pr, piece, tok, req, terminal)
                ch["logprobs"] = self._logprobs(pr, [tok], streamed, offset)
                offset += len(piece)
                params = None
                if terminal and req.out_params is not None:
                    params = req.out_params.to_dict()
                await resp.write(chunk([ch], params, terminal))
                streamed += 1
                if self.faults.exit_after_tokens and streamed >= self.faults.exit_after_tokens:
                    logger.error("fault exit_after_tokens=%d: exiting", streamed)
                    os._exit(3)
                tok = nxt
            if req.error is not None:
                await resp.write(
                    _sse(error_body(500, "Internal server error", "InternalServerError"))
                )
            if pr.include_usage:
                u = usage(req.prompt_len, len(req.output), self.core.usage_cached_tokens(req))
                c: dict[str, Any] = {
                    "id": public_id,
                    "object": obj,
                    "created": created,
                    "model": pr.model,
                    "choices": [],
                    "usage": u,
                }
                if pr.chat and not v032:
                    c["kv_transfer_params"] = None
                await resp.write(_sse(c))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            self.core.abort(req)
        return resp


def _token_choice(
    pr: ParsedRequest, text: str, tok: int, req: Request, terminal: bool
) -> dict[str, Any]:
    """The ``choices[0]`` of one streamed token (chat ``delta`` or completion ``text``)."""
    ch: dict[str, Any] = {"index": 0}
    if pr.chat:
        ch["delta"] = {"content": text}
    else:
        ch["text"] = text
    ch["logprobs"] = None
    ch["finish_reason"] = req.finish_reason if terminal else None
    ch["stop_reason"] = req.stop_reason if terminal else None
    if pr.return_token_ids:
        ch["token_ids"] = [tok]
    return ch


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def _claim_body_error(body: Any) -> str | None:
    """What is wrong with a claim body, naming the field; None when it is usable."""
    if not isinstance(body, dict):
        return "claim body must be a JSON object"
    if not isinstance(body.get("request_id"), str):
        return "claim field 'request_id' must be a string"
    blocks = body.get("blocks")
    if not isinstance(blocks, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in blocks
    ):
        return "claim field 'blocks' must be a list of integer block ids"
    return None


def build_app(routes: Routes) -> web.Application:
    app = web.Application(client_max_size=routes.core.settings.max_body_bytes)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/version", routes.version)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_post("/drop_peer", routes.drop_peer)
    app.router.add_get("/_emulator/faults", routes.faults_get)
    app.router.add_post("/_emulator/faults", routes.faults_post)
    app.router.add_post("/_emulator/claim", routes.claim)
    app.router.add_get("/_emulator/state", routes.state)
    return app
