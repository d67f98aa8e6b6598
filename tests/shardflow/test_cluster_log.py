"""While a local cluster runs, Dask's log lines and its client loop's callback tracebacks go to the run's
worker log, not the terminal; afterwards the loggers are as they were."""

from __future__ import annotations

import logging

from shardflow.cluster import DASK_LOGGERS, _dask_log_to


def test_dask_and_tornado_callback_lines_go_to_the_file_and_the_loggers_come_back(tmp_path, capfd):
    path = tmp_path / "dask-workers.log"
    path.write_text("the last run's lines\n")
    before = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
              for name in DASK_LOGGERS}
    with _dask_log_to(path):
        logging.getLogger("distributed.nanny").warning("a worker left")
        try:
            raise NameError("cannot access free variable 'future'")
        except NameError:
            logging.getLogger("tornado.application").exception("Exception in callback cancel")
    log = path.read_text()
    assert "the last run's lines" not in log
    assert "distributed.nanny - WARNING - a worker left" in log
    assert "tornado.application - ERROR - Exception in callback cancel" in log and "Traceback" in log
    out, err = capfd.readouterr()
    assert "a worker left" not in err + out and "Traceback" not in err + out
    after = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
             for name in DASK_LOGGERS}
    assert after == before
