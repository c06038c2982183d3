// The page's keys and player clock (app.py loads this as the Blocks' js): held keys become events
// {"event_id", "keys": [...]}, ids increasing per tab, queued here until a hidden button hands them to /act;
// the player's playhead and stall count are reported four times a second. Typing in a text field is ignored.
() => {
  if (window.lingbotControls) return;
  const VALID = "wasdijkl";
  const held = new Set();
  let nextId = 1;
  let pending = [];
  const typing = (el) => el && (el.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(el.tagName));
  const paint = () => {
    for (const k of VALID) {
      const b = document.getElementById("lingbot-key-" + k);
      if (b) b.classList.toggle("lingbot-held", held.has(k));
    }
  };
  const send = () => {
    const event = {event_id: nextId++, keys: [...held].sort()};
    paint();
    if (window.lingbotPlayer && window.lingbotPlayer.sendKeys(event)) return;  // the socket player: at once
    pending.push(event);
    const button = document.getElementById("lingbot-send");
    if (button) button.click();
  };
  const press = (k) => { if (!held.has(k)) { held.add(k); send(); } };
  const release = (k) => { if (held.delete(k)) send(); };
  const keyOf = (e) => (e.key && e.key.length === 1 && VALID.includes(e.key.toLowerCase())) ? e.key.toLowerCase() : null;
  document.addEventListener("keydown", (e) => {
    const k = keyOf(e);
    if (!k || e.ctrlKey || e.metaKey || e.altKey || typing(e.target)) return;
    e.preventDefault();
    if (!e.repeat) press(k);
  });
  document.addEventListener("keyup", (e) => { const k = keyOf(e); if (k) release(k); });
  window.addEventListener("blur", () => { if (held.size) { held.clear(); send(); } });
  document.addEventListener("pointerdown", (e) => {
    const button = e.target.closest && e.target.closest("[id^='lingbot-key-']");
    if (!button) return;
    const k = button.id.slice(-1);
    press(k);
    const up = () => { release(k); window.removeEventListener("pointerup", up); window.removeEventListener("pointercancel", up); };
    window.addEventListener("pointerup", up);
    window.addEventListener("pointercancel", up);
  });
  // Report the playhead while the video plays, so the server paces the world to what is on screen, and
  // how often the player ran dry, so the server adapts how far ahead of it the video arrives.
  let stalls = 0, watched = null;
  setInterval(() => {
    const v = document.querySelector("#lingbot-video video");
    if (v && v !== watched) { watched = v; v.addEventListener("waiting", () => { stalls += 1; }); }
    const button = document.getElementById("lingbot-clock");
    if (v && button && !v.paused && !v.ended && v.readyState >= 2) button.click();
  }, 250);
  window.lingbotControls = {
    take() { const out = pending; pending = []; return JSON.stringify(out); },
    held() { return [...held].sort(); },
    playhead() { const v = document.querySelector("#lingbot-video video"); return v ? `${v.currentTime} ${stalls}` : ""; },
  };
}
