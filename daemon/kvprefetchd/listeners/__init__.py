"""Every way in: the Unix socket, TCP with mutual TLS, the peers' credentials, and the
bounds strangers meet before they can make the supervisor's one loop do anything."""
