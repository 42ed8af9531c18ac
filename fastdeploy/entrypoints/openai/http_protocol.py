"""uvicorn's h11 protocol with a bound on how long a request's headers may take to arrive.

uvicorn times idle keep-alive connections but not a request whose headers trickle in (a slow or
stuck client holds its connection and a slot of the server for as long as it likes). Here each
request's headers must be complete within ``HeaderTimeoutProtocol.header_timeout`` seconds of
the connection opening or of the request's first byte; else the connection is closed and the
closing logged once at INFO.
"""

from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("fastdeploy")


def header_timeout_protocol(timeout: float) -> type[H11Protocol]:
    """The protocol class (uvicorn's ``http=``) with ``timeout`` seconds for headers."""

    class HeaderTimeoutProtocol(H11Protocol):
        header_timeout = timeout

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer = None
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state == h11.IDLE and self.conn.our_state == h11.IDLE:
                self._arm()  # a request has begun (or the connection is new): its headers are timed
            else:
                self._disarm()  # headers complete: the body and the response are the app's

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _expire(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                logger.info("closing a connection whose request headers took over %g s", self.header_timeout)
                self.transport.close()

    return HeaderTimeoutProtocol
