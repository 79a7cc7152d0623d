"""The front door: the app's own ports, joining the HTTP/1.1 and HTTP/2 transports to the protocol."""
