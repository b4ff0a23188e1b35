import pytest

from tests.services.servers import running_server


@pytest.fixture(scope="module", params=["local", "E1+P1+D1"])
def server(request, tiny_dir, tmp_path_factory):
    """The same HTTP contract from one process and from a disaggregated mesh, for each module that asks (module scope:
    a package-wide one stayed up while other modules started meshes of their own, five processes more on two cores).
    A module's SERVER_ARGS are added to `epdmesh serve`'s."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(tiny_dir, request.param, log, *getattr(request.module, "SERVER_ARGS", ())) as base:
        yield base
