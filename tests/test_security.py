"""Authentication, TLS, limits and isolation, against real server processes."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import rgpu


@pytest.fixture
def no_env_token(monkeypatch):
    monkeypatch.delenv("RGPU_TOKEN", raising=False)


def test_a_missing_or_wrong_token_is_refused_before_any_session(server, no_env_token):
    with pytest.raises(rgpu.AuthError, match="rejected the token .*none was sent.*RGPU_TOKEN"):
        rgpu.connect(server.url)
    with pytest.raises(rgpu.AuthError, match="it is not the server's"):
        rgpu.connect(server.url, token="not-the-token")
    deadline = time.time() + 5
    while "wrong token" not in server.log() and time.time() < deadline:  # the later one
        time.sleep(0.05)
    assert re.search(r"refused 127\.0\.0\.1:\d+: no token", server.log())
    assert re.search(r"refused 127\.0\.0\.1:\d+: wrong token", server.log())


def test_the_token_can_come_from_the_argument_the_environment_or_the_url(
    server, no_env_token, monkeypatch
):
    from rgpu_test_servers import TOKEN_FOR_TESTS as token

    for connect in (
        lambda: rgpu.connect(server.url, token=token),
        lambda: rgpu.connect(f"{server.url}/?token={token}"),
        lambda: (monkeypatch.setenv("RGPU_TOKEN", token), rgpu.connect(server.url))[1],
    ):
        session = connect()
        assert session.url == server.url  # the token is not kept in the URL
        assert torch.ones(2, device="rgpu").sum().item() == 2.0


def test_a_server_without_a_token_makes_one_and_prints_a_connect_url(no_env_token, start_server):
    srv = start_server(env={"RGPU_TOKEN": ""})
    m = re.search(
        r'clients connect with:  rgpu\.connect\("(ws://127\.0\.0\.1:\d+/\?token=([\w-]+))"\)',
        srv.wait_log("clients connect"),
    )
    assert m, srv.log()
    url, token = m.groups()
    assert len(token) >= 32
    rgpu.connect(url)
    assert torch.ones(3, device="rgpu").sum().item() == 3.0


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7"])
def test_no_token_is_refused_on_a_non_loopback_address(host):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rgpu_server",
            "--no-token",
            "--host",
            host,
            "--port",
            "0",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert f"refusing to listen on {host} without a token" in out.stderr


def test_no_token_on_loopback_works_and_warns(no_env_token, start_server):
    srv = start_server("--no-token")
    assert "no token: any process that can reach" in srv.wait_log("no token")
    rgpu.connect(srv.url)
    assert torch.ones(2, device="rgpu").sum().item() == 2.0


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-subj",
        "/CN=rgpu test CA",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "server.pem",
        "-extfile",
        "san.ext",
        cwd=d,
    )
    return d


def test_tls_with_a_private_ca(tls_files, monkeypatch, start_server):
    srv = start_server(
        "--certfile", str(tls_files / "server.pem"), "--keyfile", str(tls_files / "server.key")
    )
    assert srv.url.startswith("wss://127.0.0.1:")
    monkeypatch.delenv("RGPU_CA_BUNDLE", raising=False)
    with pytest.raises(rgpu.ConnectError, match="could not be verified.*RGPU_CA_BUNDLE"):
        rgpu.connect(srv.url)
    monkeypatch.setenv("RGPU_CA_BUNDLE", str(tls_files / "ca.pem"))
    rgpu.connect(srv.url)
    x = torch.randn(300_000)  # chunked transfers over TLS too
    assert torch.equal(x.to("rgpu").cpu(), x)
    big = torch.randn(3_000_000)  # and the bulk lane, over TLS as well
    assert torch.equal(big.to("rgpu").cpu(), big)
    assert rgpu.stats()["lane_transfers"] == 2


def test_the_server_limits_its_sessions(start_server):
    srv = start_server("--max-sessions", "1")
    rgpu.connect(srv.url)
    code = f"import rgpu; rgpu.connect({srv.url!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert (
        "refused this client: the rgpu server already serves its maximum of 1 sessions"
        in out.stderr
    )
    assert torch.ones(2, device="rgpu").sum().item() == 2.0  # the first session is unaffected


def test_a_session_over_its_quota_gets_an_out_of_memory_error_and_recovers(start_server):
    srv = start_server("--session-quota-mb", "9")
    rgpu.connect(srv.url)
    a = torch.zeros(1024, 1024, device="rgpu")  # 4 MiB
    big = torch.ones(1536, 1024, device="rgpu")  # 6 MiB more: over the quota, refused
    with pytest.raises(
        rgpu.RemoteError,
        match="OutOfMemoryError: this session holds .* quota on this server is 9437184",
    ):
        torch.rgpu.synchronize()
    with pytest.raises(rgpu.RemoteError, match="OutOfMemoryError"):
        big.sum().item()  # the refused tensor stays unusable
    b = a + 1  # 4 MiB more: 8 MiB held, under the quota
    with pytest.raises(rgpu.RemoteError, match="OutOfMemoryError"):
        (b * 2).sum().item()  # over it again
    del b, big
    c = (a + 2).sum().item()  # after freeing, the session works again
    assert c == 2 * 1024 * 1024
    assert rgpu.session_info()["quota"] == 9 << 20


def test_sessions_cannot_name_each_others_tensors(server):
    mine = rgpu.connect(server.url)
    secret = torch.full((4,), 42.0, device="rgpu")
    torch.rgpu.synchronize()
    code = f"""
        import torch, rgpu
        from rgpu_protocol import Kind, Ref
        s = rgpu.connect({server.url!r})
        try:
            s.request((Kind.DOWNLOAD, Ref({secret._r.id})))
        except rgpu.RemoteError as e:
            print("refused:", e)
        s.post((Kind.RUN, "fill_.Scalar", [Ref({secret._r.id}), 0.0], None, [None]))
        try:
            torch.rgpu.synchronize()
        except rgpu.RemoteError as e:
            print("refused:", e)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.count(f"no tensor with id {secret._r.id} in this session") == 2, (
        out.stdout + out.stderr
    )
    assert torch.equal(secret.cpu(), torch.full((4,), 42.0))
    assert mine is rgpu.current_session()


def test_the_server_counts_what_all_sessions_hold(start_server):
    # a server of its own, with one other client holding a tensor: on the shared server an
    # earlier test's session may free its tensors between the two reads below
    srv = start_server()
    code = (
        "import sys, torch, rgpu\n"
        f"rgpu.connect({srv.url!r})\n"
        "x = torch.ones(1024, device='rgpu')\n"
        "x.sum().item()\n"
        "print('holding', flush=True)\n"
        "sys.stdin.read()\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "holding"
        rgpu.connect(srv.url)
        before = rgpu.session_info()["server"]
        assert before["sessions"] == 2 and before["tensors"] >= 1  # the other client's too
        keep = torch.empty(256, 1024, device="rgpu")
        after = rgpu.session_info()["server"]
        assert (
            after["tensors"] == before["tensors"] + 1
            and after["bytes"] == before["bytes"] + 1024 * 1024
        )
        del keep
    finally:
        other.stdin.close()
        other.wait(timeout=60)
