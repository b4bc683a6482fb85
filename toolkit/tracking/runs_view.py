"""The MLflow page a printed link opens: the experiment's runs table, in the model-training
view, with the headline columns already shown.

Made with MLflow's own mechanisms (MLflow 3.17.2):

* the shared view state: an experiment tag `mlflow.sharedViewState.<key>` holding the
  table's columns and filter as JSON, opened by `?viewStateShareKey=<key>` (what the UI's
  "Share" button writes and reads);
* a sweep's view groups its points by their parent run, unfolded (`sweep_view_state`);
* `workflowType=machine_learning` in the link: MLflow keeps its GenAI / model-training
  toggle in the browser's localStorage, defaulting to GenAI whatever the experiment's
  `mlflow.experimentKind` tag says (mlflow/mlflow#24498); the link's parameter wins over
  it, and the `/runs` tab of the link skips the GenAI overview an experiment opens on.

MLflow 3.18.0 was not used: its `mlflow-skinny` 3.18.0 was not on the package index this
project installs from (checked 2026-11-28).
"""
from __future__ import annotations

import json

from .headline import table_metric_names

VIEW_TAG_PREFIX = "mlflow.sharedViewState."
RUNS_VIEW = "gridwright-runs"  # the experiment's runs table
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store
WORKFLOW = "workflowType=machine_learning"

# What tells runs apart, before the numbers: the layout, the engine and its ZeRO stage.
LABEL_COLUMNS = ("tags.`gridwright.layout`", "tags.`gridwright.engine`", "params.`zero.stage`")


def view_state(search_filter: str = "") -> dict:
    """The runs table's state as MLflow's UI shares it: columns, then an optional filter."""
    state = {"selectedColumns": [*LABEL_COLUMNS, *(f"metrics.`{m}`" for m in table_metric_names())],
             "orderByKey": "attributes.start_time", "orderByAsc": False}
    if search_filter:
        state["searchFilter"] = search_filter
    return state


def sweep_view_key(parent_run_id: str) -> str:
    return f"gridwright-sweep-{parent_run_id}"


def sweep_view_state(parent_run_id: str) -> dict:
    """A sweep's points: its nested runs, in one group under their parent, open. Listed
    plainly, MLflow folds nested runs under their parent's row, and which rows are unfolded
    is the one part of a table's state its shared views leave out; a group's is kept. The
    group's own row shows each column's largest value (the best throughput and MFU, the
    largest memory), a number one of the points measured: an average across layouts
    measures nothing, and MLflow prints it with every digit."""
    state = view_state(f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    state["groupBy"] = {"aggregateFunction": "max",
                        "groupByKeys": [{"mode": "tag", "groupByData": "mlflow.parentRunId"}]}
    state["groupsExpanded"] = {f"tag.mlflow.parentRunId.{parent_run_id}": True}
    return state


def publish(client, exp_id: str, key: str, state: dict) -> None:
    """Store the view with the experiment, unless it holds this one already."""
    value = json.dumps(state, sort_keys=True)
    current = client.get_experiment(exp_id).tags.get(VIEW_TAG_PREFIX + key)
    if current != value:
        client.set_experiment_tag(exp_id, VIEW_TAG_PREFIX + key, value)


def ui_base(uri: str) -> str | None:
    """The UI's address for a store: a server serves its own; a local store is served by
    `mlflow ui` on its default address; other stores have no known UI."""
    if uri.startswith("http"):
        return uri.rstrip("/")
    if uri.startswith("sqlite:///") or uri.startswith("file:") or uri.startswith("/"):
        return LOCAL_UI
    return None


def runs_table_url(base: str, exp_id: str, key: str = RUNS_VIEW) -> str:
    return f"{base}/#/experiments/{exp_id}/runs?{WORKFLOW}&viewStateShareKey={key}"


def run_url(base: str, exp_id: str, run_id: str, artifact: str = "") -> str:
    """A run's page, or with `artifact` that file in its artifacts tab."""
    return f"{base}/#/experiments/{exp_id}/runs/{run_id}" + (f"/artifacts/{artifact}" if artifact else "") + f"?{WORKFLOW}"
