# EdgeTrain — set-up, demo, tests, benchmarks. Everything runs inside .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast bench protos lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[gateway,test,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m edgetrain demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q --timeout=600

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -q -m "not slow"

bench: $(STAMP)
	$(PY) scripts/bench_memory_format.py
	$(PY) scripts/bench_dp.py --sixteen
	$(PY) scripts/bench_links.py
	$(PY) scripts/bench_aggregation.py
	$(PY) scripts/bench_pipeline.py
	$(PY) scripts/bench_planner.py
	$(PY) scripts/bench_jobs.py
	$(PY) scripts/bench_dashboard.py
	$(PY) scripts/bench_tls.py
	$(PY) scripts/bench_chaos.py
	$(PY) scripts/bench_fleet_load.py --repeat 3
	$(PY) scripts/bench_time_to_accuracy.py --keep results/bench-time-to-accuracy
	$(PY) scripts/bench_data.py

protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
