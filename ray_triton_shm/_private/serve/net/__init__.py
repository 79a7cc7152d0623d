"""What the front door's transports share: the listening socket, vectored sends, bounded reads."""
