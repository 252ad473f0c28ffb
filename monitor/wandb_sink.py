"""Weights & Biases channel: step metrics to the run's history (Keel's as train/<column>, the user's own
as custom/<name>), alerts to W&B alerts (email/Slack per the user's W&B settings).

mode "auto" logs online only when an API key is at hand (WANDB_API_KEY or a `wandb login` entry in
~/.netrc) and otherwise offline, under RUN_DIR/wandb/, for a later `wandb sync`. Offline never waits on
or talks to the network. wandb is imported only when this sink is built (it takes about a second), and
a wandb that cannot be imported or cannot start is a SinkError: the run goes on without W&B.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, get_args

from keel.monitor import metric_registry
from keel.monitor.alerts import describe
from keel.monitor.config_fields import WandbMode
from keel.monitor.custom_metrics import CUSTOM_KEY
from keel.monitor.event_kinds import EventKind
from keel.monitor.redact import redact, redact_argv
from keel.monitor.run_dir import WANDB_DIR
from keel.monitor.sinks import Event, SinkError

log = logging.getLogger("keel.monitor")

CUSTOM_PREFIX = "custom/"  # the user's own metrics (keel.monitor.custom_metrics), beside Keel's train/<column>
# An online wandb.init that cannot reach the server gives up after this long instead of wandb's 90 s.
_INIT_TIMEOUT_S = 30.0


class WandbSink:
    name = "wandb"

    def __init__(
        self,
        run_id: str,
        config: dict[str, Any],
        project: str = "keel",
        mode: WandbMode = "auto",
        *,
        run_dir: str | Path,
        alert_throttle_s: float = 300.0,
        min_interval_s: float = 0.0,
        clock=time.monotonic,
    ) -> None:
        if mode not in get_args(WandbMode):
            raise SinkError(f"monitor.wandb_mode={mode!r} is not one of {', '.join(get_args(WandbMode))}")
        try:
            import wandb
        except Exception as e:  # not only ImportError: a broken install can raise anything at import
            raise SinkError(
                f"W&B logging needs a working wandb package ({type(e).__name__}: {e}): pip install wandb, or set monitor.wandb=false"
            ) from None
        run_dir = Path(run_dir)
        offline_runs = f"{run_dir / WANDB_DIR}/offline-run-*"
        if mode == "auto":
            mode = "online" if _api_key_available() else "offline"
            if mode == "offline":
                log.info(
                    "W&B: no API key (WANDB_API_KEY or `wandb login`), logging offline; upload later with `wandb sync %s`", offline_runs
                )
        self.mode = mode
        # The step metrics the registry marks for W&B; the run store has them all.
        self._logged = {m.column: m.wandb_key for m in metric_registry.STEP_METRICS if m.wandb}
        self.alert_throttle_s = alert_throttle_s
        self.min_interval_s, self._clock = min_interval_s, clock
        self._last_logged_at: float | None = None
        self._last_attempt: int | None = None
        self._held: dict[str, Any] | None = None  # the newest step not logged yet
        self._levels = {"critical": wandb.AlertLevel.ERROR, "warning": wandb.AlertLevel.WARN, "info": wandb.AlertLevel.INFO}
        # wandb uploads the command line with the run, so `--monitor.webhook_url=...` would go with it.
        argv, sys.argv = sys.argv, redact_argv(sys.argv)
        try:
            # console="off": Keel keeps its own logs, and wandb's capture would rewrap sys.stdout for everyone.
            # reinit="create_new": a run the user's own code opened is left alone.
            settings = wandb.Settings(mode=mode, silent=True, console="off", reinit="create_new", init_timeout=_INIT_TIMEOUT_S)
            run_dir.mkdir(parents=True, exist_ok=True)  # wandb warns about a missing git root otherwise
            # The process-wide settings matter too: wandb's own usage telemetry follows them, not the run's,
            # and would post to the W&B server at exit even from an offline run. Setting them here rather
            # than WANDB_MODE/WANDB_SILENT keeps os.environ (inherited by workers) as the user left it.
            wandb.setup(wandb.Settings(mode=mode, silent=True))
            self._run = wandb.init(
                project=project, id=run_id, name=run_id, dir=run_dir, config=redact(config), resume="allow", settings=settings
            )
            # After a rollback step numbers repeat, and W&B drops rows whose step goes back: let wandb's
            # own step count rows and plot everything against train/step.
            self._run.define_metric("train/step")
            self._run.define_metric("*", step_metric="train/step")
        except Exception as e:
            raise SinkError(f"W&B could not start the run ({type(e).__name__}: {e}): {_fix(mode, offline_runs)}") from None
        finally:
            sys.argv = argv

    def on_step(self, row: dict[str, Any], rank_rows: list[dict[str, Any]]) -> None:
        """Logs the step, unless one was logged less than min_interval_s ago: a wandb.log costs about
        1 ms of CPU in the training process, too much for steps of a few ms. The run store and
        Prometheus keep every step; W&B then gets the newest step at most every min_interval_s, the
        last and first step around each new attempt (a rollback stays visible), every evaluated step (its
        validation loss comes once per eval.every steps) and the last step at close."""
        values = {key: row[column] for column, key in self._logged.items() if row.get(column) is not None}
        values |= {f"{CUSTOM_PREFIX}{name}": v for name, v in (row.get(CUSTOM_KEY) or {}).items() if v is not None}
        now = self._clock()
        new_attempt = row.get("attempt") != self._last_attempt
        if new_attempt and self._held is not None:
            self._run.log(self._held)  # where the abandoned attempt ended (a spike, say) stays visible
        evaluated = row.get("validation_loss") is not None
        due = new_attempt or evaluated or self._last_logged_at is None or now - self._last_logged_at >= self.min_interval_s
        self._last_attempt = row.get("attempt")
        if not due:
            self._held = {"train/step": row["step"], **values}
            return
        self._run.log({"train/step": row["step"], **values})
        self._last_logged_at, self._held = now, None

    def on_event(self, event: Event) -> None:
        # Offline, W&B would deliver an alert only at a later `wandb sync`, when it is stale; the run
        # store and the other channels have it already.
        if event.get("kind") != EventKind.ALERT or self.mode != "online":
            return
        data = event.get("data") or {}
        values = " ".join(f"{k}={v}" for k, v in data.get("values", {}).items())
        self._run.alert(
            title=f"keel: {data.get('alert')}",
            text=f"{describe(event)} ({values})" if values else describe(event),
            level=self._levels.get(str(event.get("severity")), self._levels["info"]),
            wait_duration=self.alert_throttle_s,
        )

    def close(self) -> None:
        if self._held is not None:
            self._run.log(self._held)
        self._run.finish()


def _fix(mode: str, offline_runs: str) -> str:
    """What to do when wandb.init failed: online, mostly the API key; offline, what failed is local (the
    error names it) and the run is better off without W&B than stopped."""
    if mode == "online":
        return f"set WANDB_API_KEY or run `wandb login`, or set monitor.wandb_mode=offline; sync later with `wandb sync {offline_runs}`"
    return "set monitor.wandb=false to leave W&B out"


def _api_key_available() -> bool:
    """Whether wandb would find an API key: WANDB_API_KEY, or a `wandb login` entry in the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import wandb
        from wandb.sdk.lib.wbauth import read_netrc_auth  # wandb's own lookup: NETRC, ~/.netrc, host aliases

        base_url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
        return read_netrc_auth(host=base_url) is not None
    except ImportError:  # that internal module moved: offline is the choice that never waits or prompts
        return False
    except Exception:  # a malformed key: go online, where wandb.init reports it and we add the fix
        return True
