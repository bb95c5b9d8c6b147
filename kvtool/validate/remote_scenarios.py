"""Scenarios for connectors with a remote store, run when `--remote URL` names the server (Redis or
Mooncake Store, see `remote_servers`) the connector under test stores into. They disrupt that
server the way production does, at the worst moment, and require every request to complete with
the bytes a run without the connector computes: a failing store may cost hits, never a wrong byte
or a failed request.

The server must be dedicated to the test: these scenarios empty it, pause it and close its
clients' connections.
"""

from __future__ import annotations

from kvtool.validate.harness import Context, Req, Scenario, run, tokens
from kvtool.validate.interventions import after_each_offering_ask, every_nth_iteration
from kvtool.validate.judges import judge_integrity, knock_on, result, skipped
from kvtool.validate.remote_servers import remote_control
from kvtool.validate.results import CheckResult

NEEDS_REMOTE = "needs --remote URL (the server the connector stores into)"
"""Why a remote scenario is skipped when `--remote` names no server."""


def _workload(T: int) -> list[Req]:
    """A request that saves a prefix, then three that would be served it, one after another."""
    prompt = tokens(70, 8 * T + 1)
    return [Req(0, prompt)] + [Req(i, prompt[:(4 + i) * T] + tokens(70 + i, T + 1), arrival=float(i))
                               for i in (1, 2, 3)]


def _judged(name: str, ctx: Context, disrupt_setup=None, on_iteration=None, counts=None) -> list[CheckResult]:
    if ctx.remote is None:
        return [skipped(name, ctx, "integrity", NEEDS_REMOTE)]
    reqs = _workload(ctx.tokens_per_block)
    r = run(ctx, reqs, setup=disrupt_setup, on_iteration=on_iteration)
    out = [judge_integrity(name, ctx, [(r, reqs)])]
    if counts is not None:
        out.append(result(name, ctx, "disrupted", bool(counts),
                          [f"disrupted after {len(counts)} asks that offered {counts} tokens"] if counts else
                          [knock_on(r, "the connector offered nothing, so there was no ask→load window to "
                                       "disrupt")]))
    return out


def lost_after_ask(ctx: Context) -> list[CheckResult]:
    if ctx.remote is None:
        return _judged("remote-lost-after-ask", ctx)   # skipped: no server
    counts: list[int] = []
    server = remote_control(ctx.remote)
    return _judged("remote-lost-after-ask", ctx, after_each_offering_ask(lambda: server.flush(), counts), counts=counts)


def restarted_empty(ctx: Context) -> list[CheckResult]:
    if ctx.remote is None:
        return _judged("remote-restarted-empty", ctx)   # skipped: no server
    server = remote_control(ctx.remote)

    def wipe_and_disconnect() -> None:
        server.flush()
        if server.can_drop_connections:
            server.drop_connections()
    return _judged("remote-restarted-empty", ctx, on_iteration=every_nth_iteration(3, wipe_and_disconnect))


def stalled(ctx: Context) -> list[CheckResult]:
    if ctx.remote is None:
        return _judged("remote-stalled", ctx)   # skipped: no server
    counts: list[int] = []
    server = remote_control(ctx.remote)
    if not server.can_pause:
        return [skipped("remote-stalled", ctx, "integrity", f"{server.kind} cannot pause its clients")]
    return _judged("remote-stalled", ctx, after_each_offering_ask(lambda: server.pause(1500), counts), counts=counts)


def connections_dropped(ctx: Context) -> list[CheckResult]:
    if ctx.remote is None:
        return _judged("remote-connections-dropped", ctx)   # skipped: no server
    server = remote_control(ctx.remote)
    if not server.can_drop_connections:
        return [skipped("remote-connections-dropped", ctx, "integrity",
                        f"{server.kind} cannot drop its clients' connections")]
    return _judged("remote-connections-dropped", ctx, on_iteration=lambda engine: server.drop_connections())


REMOTE_SCENARIOS = (
    Scenario("remote-lost-after-ask", "--remote: the server loses every block right after each offer",
             lost_after_ask, disrupts_remote=True),
    Scenario("remote-restarted-empty", "--remote: every third iteration the server is emptied and its "
                                       "connections closed", restarted_empty, disrupts_remote=True),
    Scenario("remote-stalled", "--remote: the server stops answering for 1.5 s right after each offer", stalled,
             disrupts_remote=True),
    Scenario("remote-connections-dropped", "--remote: every client connection is closed each iteration",
             connections_dropped, disrupts_remote=True),
)
