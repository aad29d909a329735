"""An S3 server of the test's own: moto's server mode on a free loopback port, as s3fs's own tests use it.

    with MotoS3("portal-data") as s3:
        settings.DATA_STORAGE_URL = "s3://portal-data/store"
        settings.DATA_STORAGE_OPTIONS = s3.options
        s3.filesystem().find("portal-data")

The portal reaches it as it reaches any bucket, through s3fs with the fsspec options in ``options``; moto takes
any key and secret. Nothing here imports Django, so the benchmarks start it before the portal is set up.
"""

from __future__ import annotations

from tests.support.portal_up import free_port

KEY, SECRET, REGION = "portal", "portal-secret", "us-east-1"


class MotoS3:
    """moto's S3 server in this process with `buckets` made in it, from start() (or entering the block) to stop()."""

    def __init__(self, *buckets: str):
        self.buckets = buckets
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None

    @property
    def options(self) -> dict:
        """The fsspec storage options that reach the server (what *_STORAGE_OPTIONS settings hold)."""
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": REGION}}

    def filesystem(self):
        """An s3fs filesystem on the server, not shared with any other (no instance cache)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options)

    def client(self):
        """A boto3 S3 client on the server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=KEY,
                            aws_secret_access_key=SECRET)

    def start(self) -> MotoS3:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        try:
            client = self.client()
            for bucket in self.buckets:
                client.create_bucket(Bucket=bucket)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
