"""Keel's alerting rules and the example Alertmanager config, checked with the real tools:
promtool (syntax and the rule unit tests), amtool (the Alertmanager config and its routing), and a
real Prometheus + Alertmanager + webhook receiver that load the rules and deliver an alert."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from servers import MetricsTarget, WebhookReceiver, start_alertmanager, start_prometheus, wait_until

from keel.monitor import alert_rules, metrics

ALERTING = Path(__file__).resolve().parents[1] / "monitor" / "alerting"
RULES = ALERTING / "keel-rules.yml"
RULE_TESTS = ALERTING / "keel-rules.test.yml"
AM_EXAMPLE = ALERTING / "alertmanager.example.yml"

EXPECTED_ALERTS = {
    "KeelNonFiniteLoss": "critical",
    "KeelLossSpike": "warning",
    "KeelTrainingStalled": "critical",
    "KeelThroughputDrop": "warning",
    "KeelLowMFU": "warning",
    "KeelHighCommShare": "warning",
    "KeelStraggler": "warning",
    "KeelValidationLossRising": "warning",
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: apt-get install prometheus prometheus-alertmanager (as .ci/run does)")
    return path


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)


def _yaml():
    import yaml  # in the test extras

    return yaml


def _load_rules() -> list[dict]:
    doc = _yaml().safe_load(RULES.read_text())
    (group,) = doc["groups"]
    assert group["name"] == "keel"
    return group["rules"]


# ------------------------------------------------------------------------------------ rules


def test_promtool_check_rules():
    proc = _run(_tool("promtool"), "check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_promtool_rule_unit_tests_pass():
    proc = _run(_tool("promtool"), "test", "rules", RULE_TESTS.name, cwd=ALERTING)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout


def test_rules_are_the_shipped_alerts_with_severity_and_annotations():
    rules = _load_rules()
    assert {r["alert"]: r["labels"]["severity"] for r in rules} == EXPECTED_ALERTS
    for r in rules:
        ann = r["annotations"]
        for key in ("summary", "description"):
            assert "{{ $labels.run_id }}" in ann[key], f"{r['alert']} {key} does not name the run"
            assert "$value" in ann[key], f"{r['alert']} {key} does not give the value"
    by_name = {r["alert"]: r for r in rules}
    assert "{{ $labels.rank }}" in by_name["KeelStraggler"]["annotations"]["summary"]
    assert "for" not in by_name["KeelNonFiniteLoss"], "a non-finite loss must alert at once"
    assert by_name["KeelThroughputDrop"]["for"] == "15m"
    assert by_name["KeelLowMFU"]["for"] == "15m"
    assert by_name["KeelHighCommShare"]["for"] == "15m"
    assert by_name["KeelStraggler"]["for"] == "10m"
    # The rules of thumb.
    assert "keel_mfu_ratio < 0.3\n" in by_name["KeelLowMFU"]["expr"] + "\n"
    assert "keel_comm_share_max_ratio > 0.3\n" in by_name["KeelHighCommShare"]["expr"] + "\n"
    assert "<= 0.95" in by_name["KeelThroughputDrop"]["expr"]
    # A straggler is judged by busy time within its pipeline stage: step times are equal in synchronous training.
    assert "< 0.75" in by_name["KeelStraggler"]["expr"] and "keel_rank_busy_seconds[10m]" in by_name["KeelStraggler"]["expr"]
    assert "keel_rank_step_duration_seconds" not in by_name["KeelStraggler"]["expr"]
    assert "on (run_id, stage)" in by_name["KeelStraggler"]["expr"]
    stalled = by_name["KeelTrainingStalled"]["expr"]
    assert re.search(r"10 \*.*quantile_over_time\(0\.5, keel_last_step_duration_seconds\[30m\]\)", stalled)
    assert "unless on (run_id) (max by (run_id) (keel_run_ended) == 1)" in stalled


def test_shipped_rules_are_the_generators_defaults():
    assert RULES.read_text() == alert_rules.render(), "regenerate: keel alert-rules --out monitor/alerting/keel-rules.yml"


def test_every_series_the_rules_read_is_in_the_vocabulary():
    exported = {m.name for m in metrics.exported()} | {metrics.STEP_DURATION.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    for rule in _load_rules():
        read = set(re.findall(r"\bkeel_[a-z_]+", rule["expr"]))
        assert read and read <= exported, f"{rule['alert']} reads {sorted(read - exported)}, which Keel does not export"


def test_generated_rules_carry_the_given_parameters_and_pass_promtool(tmp_path):
    out = tmp_path / "tuned.yml"
    argv = ["--mfu-threshold", "0.42", "--straggler-for", "90s", "--stall-floor-s", "30", "--throughput-baseline", "2h", "--out", str(out)]
    assert alert_rules.main(argv) == 0
    by_name = {r["alert"]: r for r in _yaml().safe_load(out.read_text())["groups"][0]["rules"]}
    assert "keel_mfu_ratio < 0.42" in by_name["KeelLowMFU"]["expr"] and "below 0.42" in by_name["KeelLowMFU"]["annotations"]["description"]
    assert by_name["KeelStraggler"]["for"] == "90s"
    assert "[2h] offset 2h" in by_name["KeelThroughputDrop"]["expr"]
    assert "30\n" in by_name["KeelTrainingStalled"]["expr"] and "120" not in by_name["KeelTrainingStalled"]["expr"]
    proc = _run(_tool("promtool"), "check", "rules", str(out))
    assert proc.returncode == 0 and f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mfu-for", "15x"], "mfu_for='15x': not a positive Prometheus duration; write e.g. 90s, 15m or 1h30m"),
        (["--spike-window", "0m"], "spike_window='0m': not a positive Prometheus duration"),
        (["--straggler-score", "1.5"], "straggler_score=1.5: must be a ratio in (0, 1]"),
        (["--comm-share-threshold", "-0.1"], "comm_share_threshold=-0.1: must be a ratio in (0, 1]"),
        (["--stall-factor", "0.5"], "stall_factor=0.5: must be at least 1"),
        (["--stall-floor-s", "0"], "stall_floor_s=0.0: must be positive"),
        (["--stall-factor", "inf"], "stall_factor=inf: must be a finite number"),
    ],
)
def test_bad_rule_parameters_get_one_line_naming_the_parameter(argv, message, tmp_path):
    out = tmp_path / "rules.yml"
    proc = _run(sys.executable, "-m", "keel.cli", "alert-rules", *argv, "--out", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    rules = _load_rules()
    doc = _yaml().safe_load(RULE_TESTS.read_text())
    assert doc["rule_files"] == [RULES.name]
    fires: dict[str, int] = {}
    silent: dict[str, int] = {}
    for case in doc["tests"]:
        for check in case.get("alert_rule_test", []):
            name = check["alertname"]
            expected = check.get("exp_alerts") or []
            if expected:
                fires[name] = fires.get(name, 0) + 1
                for alert in expected:
                    labels = alert.get("exp_labels", {})
                    assert "run_id" in labels and "severity" in labels, f"{name} case at {check['eval_time']}: {labels}"
                    assert set(alert.get("exp_annotations", {})) >= {"summary", "description"}, f"{name} case at {check['eval_time']}"
            else:
                silent[name] = silent.get(name, 0) + 1
    names = {r["alert"] for r in rules}
    assert names - set(fires) == set(), f"alerts without a test case that expects them to fire: {sorted(names - set(fires))}"
    assert names - set(silent) == set(), f"alerts without a test case that expects silence: {sorted(names - set(silent))}"
    assert set(fires) | set(silent) <= names, "unit tests name an alert that the rules do not define"


# ------------------------------------------------------------------------------ alertmanager


def _uncomment_examples(text: str) -> str:
    """The example config with its commented `# >>> ... # <<<` blocks (Slack) uncommented."""
    out, inside = [], False
    for line in text.splitlines():
        if "# >>>" in line:
            inside = True
            continue
        if "# <<<" in line:
            inside = False
            continue
        out.append(re.sub(r"^(\s*)# ?", r"\1", line, count=1) if inside else line)
    assert not inside, "unterminated # >>> block"
    return "\n".join(out) + "\n"


def _routes(amtool: str, config: Path, *labels: str) -> set[str]:
    proc = _run(amtool, "config", "routes", "test", f"--config.file={config}", *labels)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return set(proc.stdout.strip().split(","))


def test_alertmanager_example_config_is_valid_and_routes_keel_alerts(tmp_path):
    amtool = _tool("amtool")
    proc = _run(amtool, "check-config", str(AM_EXAMPLE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = AM_EXAMPLE.read_text()
    assert "http://127.0.0.1:9099/keel-alerts" in text
    assert re.search(r"group_by: \[alertname, run_id\]", text)
    for severity in ("critical", "warning"):
        assert _routes(amtool, AM_EXAMPLE, "alertname=KeelLowMFU", f"severity={severity}", "run_id=r1") == {"keel-webhook"}

    # The commented Slack example, uncommented, is a valid config too and adds Slack to every alert.
    slack = tmp_path / "alertmanager.slack.yml"
    slack.write_text(_uncomment_examples(text))
    proc = _run(amtool, "check-config", str(slack))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "slack_configs" in slack.read_text() and "2 receivers" in proc.stdout, proc.stdout
    for severity in ("critical", "warning"):
        assert _routes(amtool, slack, "alertname=KeelStraggler", f"severity={severity}", "run_id=r1") == {"keel-slack", "keel-webhook"}


# ---------------------------------------------------------------------------- real servers


def test_webhook_receiver_records_bodies_and_can_fail_or_be_slow():
    with WebhookReceiver() as hook:
        req = lambda body: urllib.request.Request(hook.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})  # noqa: E731
        with urllib.request.urlopen(req({"n": 1}), timeout=5) as r:
            assert r.status == 200
        hook.status = 500
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req({"n": 2}), timeout=5)
        assert e.value.code == 500
        hook.status, hook.delay = 200, 1.0
        with pytest.raises(OSError):  # a timeout
            urllib.request.urlopen(req({"n": 3}), timeout=0.2)
        assert [b["n"] for b in hook.wait_for(lambda bodies: len(bodies) == 3, timeout=5)] == [1, 2, 3]
        with pytest.raises(TimeoutError):
            hook.wait_for(lambda bodies: len(bodies) > 3, timeout=0.2)


def _exposition(run_id: str, loss: str) -> str:
    """One scrape of a two-rank run, every series the rules read."""
    lines = [
        f'keel_loss{{run_id="{run_id}"}} {loss}',
        f'keel_step_duration_seconds_count{{run_id="{run_id}"}} 1200',
        f'keel_mfu_ratio{{run_id="{run_id}"}} 0.42',
        f'keel_comm_share_ratio{{run_id="{run_id}"}} 0.12',
        f'keel_comm_share_max_ratio{{run_id="{run_id}"}} 0.13',
        f'keel_last_step_timestamp_seconds{{run_id="{run_id}"}} 4102444800',  # in the future: never stalled
        f'keel_last_step_duration_seconds{{run_id="{run_id}"}} 0.52',
        f'keel_rank_step_duration_seconds{{run_id="{run_id}",rank="0"}} 0.5',
        f'keel_rank_step_duration_seconds{{run_id="{run_id}",rank="1"}} 0.52',
        f'keel_rank_busy_seconds{{run_id="{run_id}",rank="0",stage="0"}} 0.41',
        f'keel_rank_busy_seconds{{run_id="{run_id}",rank="1",stage="0"}} 0.43',
        f'keel_run_ended{{run_id="{run_id}"}} 0',
        f'keel_nonfinite_steps_total{{run_id="{run_id}"}} 0',
        f'keel_loss_spikes_total{{run_id="{run_id}"}} 0',
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_prometheus_and_alertmanager_load_the_rules_and_deliver_an_alert(tmp_path):
    _tool("prometheus")
    with (
        MetricsTarget(_exposition("smoke", "2.5")) as target,
        WebhookReceiver() as hook,
        start_alertmanager(tmp_path, hook.url) as am,
        start_prometheus(tmp_path, [target.target], [str(RULES)], am.url) as prom,
    ):
        groups = prom.api("/api/v1/rules")["groups"]
        assert [g["name"] for g in groups] == ["keel"]
        assert {r["name"] for r in groups[0]["rules"]} == set(EXPECTED_ALERTS)

        # Every rule evaluates cleanly against real scraped series (no matching errors), and none fires.
        def evaluated() -> bool:
            rules = prom.api("/api/v1/rules")["groups"][0]["rules"]
            return (
                prom.query('up{job="keel"} == 1') != []
                and all(r.get("lastEvaluation", "").startswith("2") and r["health"] == "ok" for r in rules)
                and prom.query("keel_loss") != []
            )

        wait_until(evaluated, 15, "the rules evaluated", lambda: json.dumps(prom.api("/api/v1/rules"))[-2000:] + "\n" + prom.log_tail(1500))
        rules = prom.api("/api/v1/rules")["groups"][0]["rules"]
        assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
        assert prom.query("ALERTS") == [], "an alert is pending or firing on healthy series"

        # A NaN loss fires KeelNonFiniteLoss at once, and Alertmanager delivers it to the webhook.
        target.text = _exposition("smoke", "NaN")

        def delivered(bodies) -> bool:
            return any(
                a["labels"].get("alertname") == "KeelNonFiniteLoss" and a["labels"].get("run_id") == "smoke" and a["status"] == "firing"
                for b in bodies
                for a in b.get("alerts", [])
            )

        try:
            bodies = hook.wait_for(delivered, timeout=25)
        except TimeoutError as e:
            raise AssertionError(f"{e}\nprometheus log:\n{prom.log_tail(1500)}\nalertmanager log:\n{am.log_tail(1500)}") from None
        alert = next(a for b in bodies for a in b["alerts"] if a["labels"].get("alertname") == "KeelNonFiniteLoss")
        assert alert["labels"]["severity"] == "critical"
        assert alert["annotations"]["summary"] == "Keel run smoke: non-finite loss (value NaN)"
        assert alert["labels"]["job"] == "keel" and alert["labels"]["instance"] == target.target

    for server in (prom, am):
        assert server.proc.poll() is not None, f"{server.name} still running after stop()"
