// The page's socket player (serving/live_socket.py): frames arrive over a WebSocket on the app's own port as
// they are made, one JPEG a frame, and are drawn on a canvas by the page's own clock at the model's frame rate
// from a jitter buffer as small as playback allows. Held keys go back over the same socket the moment they
// change. app.py loads this beside controls.js; `?player=hls` in the page's address selects Gradio's HLS video
// instead (the player every API client gets).
() => {
  if (window.lingbotPlayer) return;
  const FPS = 16;
  const PREBUFFER = 2;  // frames in hand before playback starts or resumes after running dry
  const hls = new URLSearchParams(location.search).get("player") === "hls";
  const buffer = [];  // {bitmap, block, frame} in arrival order
  let ws = null, ticket = "", due = null, presented = 0, stalls = 0, dry = true, reported = 0, received = 0;
  const log = [];  // [presentation time, block, frame in block]: the latency benchmark reads it
  const canvas = () => document.getElementById("lingbot-canvas");
  const show = () => {
    const video = document.getElementById("lingbot-video"), holder = document.getElementById("lingbot-canvas-box");
    if (video) video.style.display = hls ? "" : "none";
    if (holder) holder.style.display = hls ? "none" : "";
  };
  const draw = (item) => {
    const c = canvas();
    if (!c) return;
    if (c.width !== item.bitmap.width || c.height !== item.bitmap.height) {
      c.width = item.bitmap.width; c.height = item.bitmap.height;
    }
    c.getContext("2d").drawImage(item.bitmap, 0, 0);
    item.bitmap.close();
  };
  const tick = (now) => {
    if (dry && buffer.length >= PREBUFFER && buffer[0].bitmap) { dry = false; due = now; }
    while (!dry && now >= due) {
      if (buffer.length && !buffer[0].bitmap) break;  // the next frame is still decoding: a moment more
      const item = buffer.shift();
      if (!item) { dry = true; if (presented) stalls += 1; break; }
      draw(item);
      presented += 1;
      log.push([performance.now(), item.block, item.frame]);
      if (log.length > 4096) log.splice(0, 1024);
      due += 1000 / FPS;
      if (now - due > 250) due = now;  // a long hiccup (tab in the background): do not race to catch up
    }
    if (ws && ws.readyState === 1 && now - reported > 250) {
      reported = now;
      ws.send(JSON.stringify({playhead: presented / FPS, stalls}));
    }
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
  const connect = (t) => {
    show();
    if (hls || !t || t === ticket) return;
    ticket = t;
    if (ws) ws.close();
    buffer.length = 0; presented = 0; dry = true;
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/lingbot/live?ticket=${encodeURIComponent(t)}`;
    ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    ws.onmessage = async (e) => {
      if (typeof e.data === "string") { const m = JSON.parse(e.data); if (m.type === "error") console.warn("player:", m.text); return; }
      received += e.data.byteLength;
      const head = new DataView(e.data, 0, 16);
      const item = {bitmap: null, block: head.getUint32(0, true), frame: head.getUint32(4, true)};
      buffer.push(item);  // in arrival order; drawn once decoded
      item.bitmap = await createImageBitmap(new Blob([new Uint8Array(e.data, 16)], {type: "image/jpeg"}));
    };
    ws.onclose = () => { if (ws && ws.url === url) ws = null; };
  };
  window.lingbotPlayer = {
    socket: !hls,
    connect,
    connected() { return !!ws && ws.readyState === 1; },
    sendKeys(event) { if (ws && ws.readyState === 1) { ws.send(JSON.stringify(event)); return true; } return false; },
    presented() { return log.slice(); },
    stalls() { return stalls; },
    buffered() { return buffer.length; },
    received() { return received; },
  };
  show();
}
