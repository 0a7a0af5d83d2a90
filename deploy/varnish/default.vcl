# Varnish in front of the bookstore (docs/http.md). It honours the app's Cache-Control
# (s-maxage is the TTL here, stale-while-revalidate the grace), keeps no response that
# states no lifetime (no max-age, s-maxage or Expires), revalidates expired
# objects with If-None-Match (the app answers 304 from L1/L2), and takes purges from
# localhost: by cache key (PURGE + X-Cache-Key) and by tag (BAN + X-Cache-Tag), matched
# against the X-Cache-Key / X-Cache-Tags headers that layered_cache.asgi puts on each
# response. Bans test only obj.* fields, so the ban lurker clears them in the background.
vcl 4.1;

import std;

backend default {
    .host = "127.0.0.1";
    .port = "8000";
}

acl purgers {
    "127.0.0.1";
    "::1";
}

sub vcl_recv {
    if (req.method == "PURGE" || req.method == "BAN") {
        if (client.ip !~ purgers) {
            return (synth(405, "Not allowed"));
        }
        if (req.method == "PURGE" && req.http.X-Cache-Key) {
            if (std.ban("obj.http.X-Cache-Key == " + req.http.X-Cache-Key)) {
                return (synth(200, "Purged"));
            }
            return (synth(400, std.ban_error()));
        }
        if (req.method == "BAN" && req.http.X-Cache-Tag) {
            # ",book:42," as a regex: "." and "+" (the only special characters a tag may
            # hold) become the classes "[.]" and "[+]".
            if (std.ban("obj.http.X-Cache-Tags ~ ," +
                        regsuball(req.http.X-Cache-Tag, "([.+])", "[\1]") + ",")) {
                return (synth(200, "Banned"));
            }
            return (synth(400, std.ban_error()));
        }
        return (synth(400, "PURGE needs X-Cache-Key, BAN needs X-Cache-Tag"));
    }
}

sub vcl_backend_response {
    # A response that states no lifetime (no max-age/s-maxage, no Expires: a route not
    # built by layered_cache.asgi) would be kept default_ttl (120 s) with no X-Cache-Key
    # for a purge to find: its data stale for 2 minutes after a change. Not kept; marked
    # hit-for-miss (as the built-in VCL marks no-store) so requests for it go straight
    # to the app, side by side, and a later response with a lifetime is kept again.
    if (beresp.http.Cache-Control !~ "(?i)(s-maxage|max-age)" && !beresp.http.Expires) {
        set beresp.ttl = 120s;
        set beresp.grace = 0s;
        set beresp.uncacheable = true;
        return (deliver);
    }
    # Past s-maxage, serve stale only as long as the app allows (stale-while-revalidate
    # sets the grace); Varnish's default 10 s grace would stretch the freshness bound.
    if (beresp.http.Cache-Control !~ "stale-while-revalidate") {
        set beresp.grace = 0s;
    }
    # Keep expired objects a while so Varnish revalidates them with If-None-Match
    # instead of fetching the body again.
    set beresp.keep = 1h;
}

sub vcl_deliver {
    if (obj.hits > 0) {
        set resp.http.X-Cache = "HIT";
    } else {
        set resp.http.X-Cache = "MISS";
    }
    # The purge handles are for Varnish, not for clients.
    unset resp.http.X-Cache-Key;
    unset resp.http.X-Cache-Tags;
}
