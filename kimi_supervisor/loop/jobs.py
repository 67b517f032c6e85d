"""The teardown job: a teardown (teardown/escalation.py), after the switch's warming
(loop/warming.py), run on a thread of its own, which changes nothing the loop owns. Its progress
(`JobEvent`, `Warmed`) and its end (`JobDone`) come back through the inbox; the loop applies them
in loop/lifecycle.py.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from kimi_supervisor.config import Config
from kimi_supervisor.loop import warming
from kimi_supervisor.loop.context import Context
from kimi_supervisor.loop.inbox import JobDone, JobEvent, Message, Warmed
from kimi_supervisor.loop.loopstate import Job
from kimi_supervisor.ports import pagecache
from kimi_supervisor.ports.http import request as http_request
from kimi_supervisor.ports.systemd import SystemdError
from kimi_supervisor.status import WarmStatus
from kimi_supervisor.teardown.escalation import Teardown

# The last /health probe of a serving vLLM before its stop: it answers in milliseconds while it
# serves; one that does not within this is not waited for (its last 200 stays the loop's).
PROBE_S = 1.0


def shutdown_budget_s(config: Config) -> float:
    """How long one shutdown teardown may take (asked of systemd with EXTEND_TIMEOUT_USEC)."""
    t = config.teardown
    return (
        t.term_grace_s
        + t.cgroup_kill_timeout_s
        + t.strays_timeout_s
        + t.holders_timeout_s
        + t.release_timeout_s
        + 30
    )


class Jobs:
    def __init__(self, ctx: Context, put: Callable[[Message], None]) -> None:
        self.ctx = ctx
        self.s = ctx.s
        self._put = put

    def run(self, job: Job) -> None:
        """Start `job`'s teardown on the job thread (its warming first, where it has an argv);
        its JobDone comes back through the inbox."""
        s, ctx = self.s, self.ctx
        s.job = job
        put, warm_argv = self._put, job.warm_argv
        config = ctx.config
        if job.cause.startswith(("hung:", "unhealthy:")):
            # A hung vLLM finishes no request: its unit's graceful stop is not waited out.
            grace = min(config.liveness.hang_term_grace_s, config.teardown.term_grace_s)
            config = config.model_copy(
                update={"teardown": config.teardown.model_copy(update={"term_grace_s": grace})}
            )
        td = Teardown(
            config,
            ctx.systemd,
            ctx.gpu,
            ctx.clock,
            dict(s.baselines),
            on_event=lambda e: put(JobEvent(e)),
            in_daemon=True,
            listed_since=ctx.observer.first_listed.snapshot(),
        )

        url, clock = ctx.config.vllm.health_url, ctx.clock
        peer_uid = ctx.observer.vllm_uid  # read here: the job's thread only uses it
        # Where vLLM's unit will look for the model (its user's hub cache), read here, on the
        # loop's thread, which owns the bus.
        env, home = warming.vllm_env(ctx.systemd, ctx.unit) if warm_argv else ({}, None)

        def adopt(pid: int) -> str:
            """The warming's reader into a scope of its own, outside the daemon's unit: where
            it is then, or "" (it stays in the unit, whose stop a stuck read would hold)."""
            name = f"{pagecache.SCOPE_PREFIX}{pid}.scope"
            try:
                ctx.systemd.move_to_scope(
                    name, pid, "kimi-supervisor: reading a model into the cache"
                )
            except SystemdError as e:
                ctx.log("warm_scope_failed", level="warning", pid=pid, error=str(e))
                return ""
            return name

        def run() -> None:
            if warm_argv is not None:
                try:
                    end = warming.warm(
                        ctx.config.warm,
                        warm_argv,
                        job.stop_warm,
                        clock=clock,
                        report=lambda w: put(Warmed(w)),
                        adopt=adopt,
                        why=lambda: job.stop_warm_why,
                        env={**os.environ, **env} if home is None else env,
                        home=home,
                    )
                except Exception as e:  # a warming never stops the switch
                    end = WarmStatus(under_way=False, text=f"nothing warmed: it failed: {e!r}")
                put(Warmed(end, done=True))
            ok_at = None
            if job.probe and http_request(url, timeout_s=PROBE_S, peer_uid=peer_uid).status == 200:
                ok_at = clock.monotonic()
            began = clock.monotonic()
            try:
                put(JobDone(td.run(), ok_at=ok_at, began=began))
            except BaseException as e:  # reported to the loop, which decides
                put(JobDone(None, e, ok_at, began))

        threading.Thread(target=run, name="teardown", daemon=True).start()
