import pytest

from tests.services.servers import running_server


@pytest.fixture(scope="package", params=["local", "E1+P1+D1"])
def server(request, tiny_dir, tmp_path_factory):
    """The same HTTP contract from one process and from a disaggregated mesh (shared by the gateway's test modules)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(tiny_dir, request.param, log) as base:
        yield base
