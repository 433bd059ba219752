# EdgeTrain — set-up, demo, tests, benchmarks. Everything runs inside .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast test-floor bench protos lint clean

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

# The oldest torch EdgeTrain supports (a Jetson's JetPack 6.1 ships 2.5.0a0): the unit tests of the
# code that touches torch, and one multi-process exactness test, in a venv of its own
FLOOR_TORCH ?= 2.5.0
FLOOR_VENV  ?= .venv-floor
FLOOR_TESTS := tests/test_models.py tests/test_training.py tests/test_compression.py tests/test_tensors.py \
	tests/test_stage_state.py tests/test_channels.py tests/test_data.py tests/test_sampling.py tests/test_versions.py \
	tests/test_allocator.py tests/test_arriving_parameters.py tests/test_streamed_upload.py tests/test_worker.py \
	tests/test_dp_integration.py::test_three_client_dp_equals_single_process_sgd

test-floor:
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e '.[test]' 'torch==$(FLOOR_TORCH)'
	$(FLOOR_VENV)/bin/python -c "import torch; print('floor torch', torch.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -n 2 -q --timeout=600 -p no:cacheprovider $(FLOOR_TESTS)

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
	rm -rf $(VENV) $(FLOOR_VENV) runs .pytest_cache
