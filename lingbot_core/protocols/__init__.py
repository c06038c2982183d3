"""Other engines' realtime protocols, spoken both ways (a client of their servers, a server of ours)."""
