// Live status without a reload. An element with data-poll-url is replaced, every
// 1.5 s, by the fragment the server renders at that URL. A settled fragment comes
// back without data-poll-url, so polling stops by itself; an empty one (a deleted
// environment's row) removes the element.
(function () {
  "use strict";
  var POLL_INTERVAL_MS = 1500;

  function schedule(element) {
    setTimeout(function () { refresh(element); }, POLL_INTERVAL_MS);
  }

  // The last row gone, a table says what it would have said when rendered empty.
  function removeRow(element) {
    var table = element.closest("table[data-empty-text]");
    element.remove();
    if (table && table.tBodies[0].rows.length === 0) {
      var note = document.createElement("p");
      note.className = "empty";
      note.textContent = table.dataset.emptyText;
      table.replaceWith(note);
    }
  }

  // Tells the page a live element was replaced (replacement null: removed); the flash messages listen.
  function announce(element, replacement) {
    document.dispatchEvent(new CustomEvent("portal:live-replaced", { detail: { old: element, replacement: replacement } }));
  }

  // A fragment the server renders, as a template's content; null when polling should stop quietly:
  // a redirect means the session ended (the login page), a 404 that the object is gone.
  function fetchFragment(url) {
    return fetch(url, { credentials: "same-origin" })
      .then(function (response) {
        if (response.redirected || response.status === 404) return null;
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.text();
      })
      .then(function (html) {
        if (html === null) return null;
        var template = document.createElement("template");
        template.innerHTML = html.trim();
        return template.content;
      });
  }
  window.portalFetchFragment = fetchFragment;  // the log's Follow polls with it too

  function refresh(element) {
    if (!element.isConnected) return;
    fetchFragment(element.dataset.pollUrl)
      .then(function (content) {
        if (content === null) return;
        var replacement = content.firstElementChild;
        if (!replacement) { removeRow(element); announce(element, null); return; }
        element.replaceWith(replacement);
        announce(element, replacement);
        if (replacement.dataset.pollUrl) schedule(replacement);
      })
      .catch(function () { schedule(element); });  // A blip in the network: try again.
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-poll-url]").forEach(schedule);
  });

  // Forms that change something irreversible ask first.
  document.addEventListener("submit", function (event) {
    var question = event.target.dataset && event.target.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  });
})();

// Flash messages, the menu button and the error summary.
(function () {
  "use strict";
  // The state a live fragment shows: its first state badge (environment, job, endpoint, partition change).
  var STATE = '[data-testid="state"], [data-testid$="-state"]';

  function stateOf(element) {
    var badge = element && (element.matches(STATE) ? element : element.querySelector(STATE));
    return badge ? badge.textContent.trim() : null;
  }

  function currentStates() {
    return Array.prototype.map.call(document.querySelectorAll(STATE), function (badge) { return badge.textContent.trim(); });
  }

  function removeMessage(message) {
    var box = message.closest("[data-messages]");
    if (message.contains(document.activeElement)) document.getElementById("content").focus();
    message.remove();
    if (box && !box.querySelector("[data-message]")) box.remove();
  }

  // A message that names its states (extra_tags "state:requested provisioning") goes once no badge on
  // the page shows one of them.
  function dropStaleMessages() {
    var states = currentStates();
    if (!states.length) return;
    document.querySelectorAll("[data-message][data-state]").forEach(function (message) {
      var described = message.dataset.state.split(" ");
      if (!described.some(function (state) { return states.indexOf(state) !== -1; })) removeMessage(message);
    });
  }

  // A table scrolls sideways inside its card rather than widening the page; its wrapper takes the
  // keyboard's focus (arrow keys scroll it) and is named for screen readers.
  function tableName(table) {
    if (table.caption) return table.caption.textContent.trim();
    var box = table.closest("section, article, .card");
    var heading = box && box.querySelector("h2, h3");
    return (heading ? heading.textContent.trim() : document.title.split(" · ")[0]) + " (table)";
  }

  function wrapTables(root) {
    if (!root || !root.querySelectorAll) return;
    root.querySelectorAll("table").forEach(function (table) {
      var wrapper = table.parentElement;
      if (!wrapper.classList.contains("table-scroll")) {
        wrapper = document.createElement("div");
        wrapper.className = "table-scroll";
        wrapper.dataset.wrapped = "";
        table.before(wrapper);
        wrapper.appendChild(table);
      }
      if (!wrapper.hasAttribute("tabindex")) wrapper.tabIndex = 0;
      if (!wrapper.hasAttribute("role")) wrapper.setAttribute("role", "region");
      if (!wrapper.hasAttribute("aria-label") && !wrapper.hasAttribute("aria-labelledby")) {
        wrapper.setAttribute("aria-label", tableName(table));
      }
    });
  }

  document.addEventListener("portal:live-replaced", function (event) {
    wrapTables(event.detail.replacement);
    // The last row gone, live.js puts a note where the table was: the empty wrapper goes too.
    document.querySelectorAll(".table-scroll[data-wrapped]").forEach(function (wrapper) {
      if (!wrapper.querySelector("table")) wrapper.replaceWith.apply(wrapper, wrapper.childNodes);
    });
    var before = stateOf(event.detail.old), after = stateOf(event.detail.replacement);
    if (before !== after) document.querySelectorAll("[data-message][data-until-state-changes]").forEach(removeMessage);
    dropStaleMessages();
  });

  document.addEventListener("click", function (event) {
    var target = event.target;
    if (target.closest(".message-dismiss")) { removeMessage(target.closest("[data-message]")); return; }
    var menuButton = target.closest(".menu-button");
    if (menuButton) {
      var open = menuButton.getAttribute("aria-expanded") !== "true";
      menuButton.setAttribute("aria-expanded", String(open));
      menuButton.closest("[data-topbar]").classList.toggle("is-open", open);
      return;
    }
    // A link of the error summary puts the caret in its field, not just the field in view.
    var link = target.closest("[data-error-summary] a[href^='#']");
    var field = link && document.getElementById(link.getAttribute("href").slice(1));
    if (field) {
      event.preventDefault();
      var details = field.closest("details");
      if (details) details.open = true;
      field.scrollIntoView({ block: "center" });
      field.focus();
    }
  });

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll(".message-dismiss").forEach(function (button) { button.hidden = false; });
    document.querySelectorAll("[data-topbar]").forEach(function (bar) { bar.classList.add("has-menu"); });
    wrapTables(document);
    dropStaleMessages();
    var summary = document.querySelector("[data-error-summary]");
    if (summary) summary.focus();
  });
})();

// Job logs: shown scrolled to the newest line; "Follow" re-reads the replica's log every poll and
// stays at the bottom, until it is unticked or the job is over.
(function () {
  "use strict";
  var FOLLOW_INTERVAL_MS = 1500;

  function toBottom(card) {
    var text = card.querySelector("[data-log-text]");
    if (text) text.scrollTop = text.scrollHeight;
  }

  function following(card) {
    var toggle = card.querySelector("[data-log-follow]");
    return toggle && toggle.checked;
  }

  function follow(card) {
    if (!card.isConnected || !following(card) || card.dataset.polling) return;
    card.dataset.polling = "true";
    setTimeout(function () {
      delete card.dataset.polling;
      if (!following(card)) return;
      window.portalFetchFragment(card.dataset.logUrl)
        .then(function (content) {
          if (content === null) return;
          var fresh = content.querySelector("[data-log-url]");
          if (!fresh) return;
          // Only the words change: the log keeps its focus and the picker its place.
          ["[data-log-text]", "[data-log-label]"].forEach(function (selector) {
            var mine = card.querySelector(selector), theirs = fresh.querySelector(selector);
            if (mine && theirs && mine.textContent !== theirs.textContent) mine.textContent = theirs.textContent;
          });
          // The Download link follows too: after a requeue it fetches the attempt now shown.
          var download = card.querySelector("[data-log-download]"), freshDownload = fresh.querySelector("[data-log-download]");
          if (freshDownload && !download) {
            var tools = card.querySelector(".log-tools");
            if (tools) tools.appendChild(freshDownload);
          } else if (download && freshDownload && download.getAttribute("href") !== freshDownload.getAttribute("href")) {
            download.setAttribute("href", freshDownload.getAttribute("href"));
          }
          if (following(card)) toBottom(card);
          if (fresh.dataset.final) {
            var toggle = card.querySelector("[data-log-follow]");
            if (toggle) toggle.checked = false;
            return;
          }
          follow(card);
        })
        .catch(function () { follow(card); });
    }, FOLLOW_INTERVAL_MS);
  }

  document.addEventListener("change", function (event) {
    if (!event.target.matches("[data-log-follow]")) return;
    var card = event.target.closest("[data-log-url]");
    if (event.target.checked) { toBottom(card); follow(card); }
  });

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-log-url]").forEach(function (card) {
      toBottom(card);
      follow(card);
    });
  });
})();
