"""Publishing a reduction: the sinks that write what a researcher reads. Reducing writes nothing itself.

The registered analysis goes to RUN/summary.json and RUN/report.md (with its plots); a post-hoc view
goes to RUN/views/<what changed>/, never over the registered files. More sinks (a table export, an
experiment tracker) plug in here, each one module imported only when it is configured.
"""

from twinrun.files import make_dir, write_json
from twinrun.publish.report import write_report
from twinrun.storage.rundir import RunDir


def publish(reduction, report=write_report) -> None:
    """Write a Reduction (twinrun.analysis.reduce): the registered summary, or the post-hoc view.
    `report`: the measurement kind's report writer (out_dir, summary, index), the probe's by default."""
    rd = reduction.index.run_dir
    if reduction.view is None:
        write_json(rd.summary_json, reduction.summary)
        report(rd.path, reduction.summary, reduction.index)
        return
    out = make_dir(rd.view_dir(reduction.view_name))
    write_json(RunDir(out).summary_json, reduction.view)
    report(out, reduction.view, reduction.index)
